"""The OpenAI wire formats: request/response models and the serving logic that maps them onto the engine."""
