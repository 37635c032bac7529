"""The pooling endpoints: /v1/embeddings, /v1/rerank, /v1/score (wire models and serving)."""
