"""How tokens are made: the decode loop, sampling, stopping, detokenizing, batching and the engine. Knows nothing of HTTP."""
