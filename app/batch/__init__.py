"""Batch jobs: OpenAI's Files and Batches API, and the same job offline (`python -m app batch`).

A batch is a JSONL file of requests (`{"custom_id", "method", "url", "body"}`), run line by line through the very
serving code an HTTP client reaches (app/entry.py, the entry below HTTP), so a line's answer is what the route
would have answered for that body. Metadata lives in SQLite beside the file bodies (store.py), each final answer is
committed once, and a server that starts again resumes what it was doing (runner.py). Batch lines are the engine's
background class: they run in the capacity interactive requests leave free, plus a share (runner.py says how).
"""
