"""Batch jobs: OpenAI's Files and Batches API, and the same job offline (`python -m app batch`).

A batch is a JSONL file of requests (`{"custom_id", "method", "url", "body"}`), run line by line through the very
route code an HTTP client reaches (dispatch.py calls the ASGI app in-process), so a line's answer is what the route
would have answered for that body. Metadata lives in SQLite beside the file bodies (store.py), each finished line is
committed once, and a server that starts again resumes what it was doing (runner.py). Batch lines run only in the
capacity interactive requests leave idle (runner.py says how).
"""
