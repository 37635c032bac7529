"""The repository's tools, not shipped in the wheel: benchmarks (the decode loop, a load client for any
OpenAI-compatible server, peer comparisons, model-size scaling, a soak), the peers' builders and the docs' figures.
Run from a clone: `python -m benchmarks --help`."""
