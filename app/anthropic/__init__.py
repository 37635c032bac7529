"""Anthropic's Messages API over the chat completions serving path (see protocol.py and serving.py)."""
