"""Serving the pooling endpoints: inputs -> token rows (on a prepare worker) -> the embedding engine -> the wire.

Rerank and score with a bi-encoder use its own vectors: the relevance of a document to a query is the cosine
similarity of their embeddings (vLLM does the same for embedding models). A cross-encoder (app/models/cross_encoder.py)
reads each (query, document) pair in one pass and its score is the relevance; it gives no embeddings.
"""

from __future__ import annotations

import base64
import time
import uuid

import torch
from fastapi import Request

from app.errors import InvalidRequest, ModelNotFound
from app.openai.embeddings.protocol import EmbeddingRequest, RerankRequest, ScoreRequest

# OpenAI's own per-request limits for /v1/embeddings, so that a client batching for OpenAI fits here too.
MAX_INPUTS = 2048
MAX_TOTAL_TOKENS = 300_000
ENDPOINTS = ["/v1/embeddings", "/v1/rerank", "/v1/score"]
PAIR_ENDPOINTS = ["/v1/rerank", "/v1/score"]  # a cross-encoder's


class EmbeddingServing:
    def __init__(self, engine, lm, model_id: str, preparing, metrics):
        self.engine, self.lm, self.model_id = engine, lm, model_id
        self.preparing, self.metrics = preparing, metrics

    @property
    def endpoints(self) -> list[str]:
        return PAIR_ENDPOINTS if self.lm.scores_pairs else ENDPOINTS

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise ModelNotFound(f"model {model!r} is not served here; this server serves {self.model_id!r}")

    # ---- endpoints ----

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> dict:
        self.check_model(body.model)
        if self.lm.scores_pairs:
            raise InvalidRequest(f"{self.model_id} is a cross-encoder: it scores pairs of texts on "
                                 f"{', '.join(PAIR_ENDPOINTS)} and gives no embeddings", param="model",
                                 code="unsupported_endpoint")
        size = self._dimensions(body.dimensions)
        rows = await self.preparing.run(self.token_rows, body.inputs(), body.truncate_prompt_tokens, "input")
        vectors = await self._embed(rows, "embeddings", request)
        if size != self.lm.dimensions:  # a Matryoshka prefix, renormalised if the model's vectors are unit length
            vectors = vectors[:, :size]
            if self.lm.config.normalize:
                vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
        data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, body.encoding_format)}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": self.model_id, "usage": usage(rows)}

    async def rerank(self, body: RerankRequest, request: Request) -> dict:
        self.check_model(body.model)
        texts = body.texts()
        if not texts:
            raise InvalidRequest("`documents` is empty; give at least one document", param="documents")
        if not body.query:
            raise InvalidRequest("`query` is an empty string", param="query")
        scores, rows = await self._relevance([body.query], texts, body.truncate_prompt_tokens, request, "rerank",
                                             ("query", "documents"))
        order = sorted(range(len(texts)), key=lambda i: -scores[i])
        if body.top_n:
            order = order[:body.top_n]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": texts[i]}} if body.return_documents else {})} for i in order]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": self.model_id, "results": results,
                "usage": {"total_tokens": usage(rows)["total_tokens"]}}

    async def score(self, body: ScoreRequest, request: Request) -> dict:
        self.check_model(body.model)
        first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if not first or not second:
            raise InvalidRequest("`text_1` and `text_2` must each hold at least one text",
                                 param="text_1" if not first else "text_2")
        if len(first) != 1 and len(first) != len(second):
            raise InvalidRequest(f"`text_1` has {len(first)} texts and `text_2` {len(second)}: give one `text_1` "
                                 "to score against every `text_2`, or lists of the same length", param="text_1")
        scores, rows = await self._relevance(first, second, body.truncate_prompt_tokens, request, "score",
                                             ("text_1", "text_2"))
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.model_id, "data": data, "usage": usage(rows)}

    # ---- shared steps ----

    async def _relevance(self, first: list[str], second: list[str], truncate: int | None, request: Request,
                         endpoint: str, params: tuple[str, str]) -> tuple[list[float], list[list[int]]]:
        """One score per text of `second`, against `first[0]` (one text) or `first[i]` (pairwise): a cross-encoder
        reads each pair; a bi-encoder embeds every text once and compares the vectors by cosine. Also the rows run,
        for `usage`."""
        firsts = first * len(second) if len(first) == 1 else first
        if self.lm.scores_pairs:
            rows = await self.preparing.run(self.pair_rows, firsts, second, truncate, params[1])
            return (await self._embed(rows, endpoint, request))[:, 0].tolist(), rows
        rows_1 = await self.preparing.run(self.token_rows, first, truncate, params[0])
        rows_2 = await self.preparing.run(self.token_rows, second, truncate, params[1])
        vectors = await self._embed(rows_1 + rows_2, endpoint, request)
        left = vectors[:len(first)].expand(len(second), -1) if len(first) == 1 else vectors[:len(first)]
        return torch.nn.functional.cosine_similarity(left, vectors[len(first):], dim=1).tolist(), rows_1 + rows_2

    def pair_rows(self, firsts: list[str], seconds: list[str], truncate: int | None, param: str) -> list[list[int]]:
        """A cross-encoder's rows: each (first, second) pair tokenized together, with the same limits as texts."""
        return self.token_rows(list(zip(firsts, seconds)), truncate, param)

    def _dimensions(self, asked: int | None) -> int:
        native = self.lm.dimensions
        if asked is None or asked == native:
            return native
        if not self.lm.config.matryoshka:
            raise InvalidRequest(f"`dimensions`: {self.model_id} gives {native}-dimensional vectors and was not "
                                 "trained for shorter ones; leave `dimensions` out", param="dimensions")
        if asked > native:
            raise InvalidRequest(f"`dimensions` is {asked}; {self.model_id} gives at most {native}",
                                 param="dimensions")
        return asked

    def token_rows(self, inputs: list[str | list[int] | tuple[str, str]], truncate: int | None,
                   param: str) -> list[list[int]]:
        """Texts -> token rows (with the model's special tokens), token-id lists as given; every limit checked.
        Runs on a prepare worker: tokenizing 2,048 texts is not the event loop's work."""
        limit = self.lm.max_context
        if not inputs:
            raise InvalidRequest(f"`{param}` is empty; give at least one input", param=param)
        if len(inputs) > MAX_INPUTS:
            raise InvalidRequest(f"`{param}` has {len(inputs):,} inputs; at most {MAX_INPUTS:,} are accepted per "
                                 "request", param=param, code="too_many_items")
        if truncate is not None and not (truncate == -1 or truncate >= 1):
            raise InvalidRequest("`truncate_prompt_tokens` must be -1 (the model's limit) or at least 1",
                                 param="truncate_prompt_tokens")
        if truncate is not None and truncate > limit:
            raise InvalidRequest(f"`truncate_prompt_tokens` is {truncate}; {self.model_id} takes at most {limit} "
                                 "tokens per input", param="truncate_prompt_tokens")
        keep = None if truncate is None else (limit if truncate == -1 else truncate)
        rows, total = [], 0
        for i, item in enumerate(inputs):
            where = f"{param}[{i}]" if len(inputs) > 1 else param
            if isinstance(item, tuple):  # a cross-encoder's (first, second) pair
                if not item[0] or not item[1]:
                    raise InvalidRequest(f"`{where}` pairs an empty string; every text needs words", param=param)
                row = self.lm.encode_pair(*item, keep)
            elif isinstance(item, str):
                if not item:
                    raise InvalidRequest(f"`{where}` is an empty string; every input needs text", param=param)
                row = self.lm.encode_text(item, keep)
            else:
                if not item:
                    raise InvalidRequest(f"`{where}` is an empty token list", param=param)
                bad = [t for t in item if t >= self.lm.vocab_size]
                if bad:
                    raise InvalidRequest(f"`{where}` has token ids outside the vocabulary: {bad[:5]}", param=param)
                row = list(item if keep is None else item[:keep])
            if len(row) > limit:
                raise InvalidRequest(f"`{where}` has {len(row):,} tokens; {self.model_id} takes at most {limit} "
                                     "per input (set `truncate_prompt_tokens` to cut longer inputs)", param=param,
                                     code="context_length_exceeded")
            total += len(row)
            if total > MAX_TOTAL_TOKENS:
                raise InvalidRequest(f"`{param}` holds more than {MAX_TOTAL_TOKENS:,} tokens in all, the most one "
                                     "request may; split it", param=param, code="too_many_tokens")
            rows.append(row)
        return rows

    async def _embed(self, rows: list[list[int]], endpoint: str, request: Request) -> torch.Tensor:
        tokens = sum(len(r) for r in rows)
        request.state.prompt_tokens = tokens  # the access log's `prompt=`
        vectors = torch.stack(await self.engine.embed(rows))  # [rows, H]
        self.metrics.embedding_requests.labels(endpoint).inc()
        self.metrics.embedding_tokens.inc(tokens)
        self.metrics.embedding_inputs.inc(len(rows))
        return vectors


def cosine(a: torch.Tensor, b: torch.Tensor) -> list[list[float]]:
    """[A, H] x [B, H] -> A lists of B cosine similarities."""
    a, b = torch.nn.functional.normalize(a, dim=1), torch.nn.functional.normalize(b, dim=1)
    return (a @ b.T).tolist()


def encode_vector(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """`base64`: the little-endian float32 bytes, base64-encoded, as OpenAI sends them (its SDK decodes with
    numpy's frombuffer(dtype="float32"))."""
    if encoding_format == "base64":
        return base64.b64encode(vector.to(torch.float32).numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def usage(rows: list[list[int]]) -> dict[str, int]:
    tokens = sum(len(r) for r in rows)
    return {"prompt_tokens": tokens, "total_tokens": tokens}
