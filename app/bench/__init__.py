"""Benchmarks: the decode loop, a load client for any OpenAI-compatible server, and peer comparisons."""
