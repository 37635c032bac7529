"""simple-serve: an OpenAI-compatible server around a readable, exact decode loop."""
