"""Serving the pooling endpoints: inputs -> token rows (on a prepare worker) -> the embedding engine -> the wire.

Rerank and score with a bi-encoder use its own vectors: the relevance of a document to a query is the cosine
similarity of their embeddings (vLLM does the same for embedding models). A cross-encoder (app/models/cross_encoder.py)
reads each (query, document) pair in one pass and its score is the relevance; it gives no embeddings.

Limits count a request's inputs together: both sides of a bi-encoder's rerank and score against MAX_INPUTS and
MAX_TOTAL_TOKENS. Deadlines are the generation routes' (app/deadlines.py): QUEUE_TIMEOUT_S, REQUEST_TIMEOUT_S and
`x-request-timeout`; a request whose rows still wait for the engine when one passes gets the same 503 with
Retry-After (app/core/engine/embedding.py).
"""

from __future__ import annotations

import base64
import time
import uuid

import torch
from fastapi import Request

from app.deadlines import HEADER, header_timeout, request_deadlines
from app.errors import InvalidRequest, ModelNotFound
from app.openai.embeddings.protocol import (MAX_INPUTS, MAX_TOTAL_TOKENS, EmbeddingRequest, RerankRequest,
                                            ScoreRequest)

ENDPOINTS = ["/v1/embeddings", "/v1/rerank", "/v1/score"]
PAIR_ENDPOINTS = ["/v1/rerank", "/v1/score"]  # a cross-encoder's


class EmbeddingServing:
    def __init__(self, engine, lm, model_id: str, preparing, metrics, queue_timeout_s: float | None = None,
                 request_timeout_s: float | None = None):
        self.engine, self.lm, self.model_id = engine, lm, model_id
        self.preparing, self.metrics = preparing, metrics
        self.queue_timeout_s, self.request_timeout_s = queue_timeout_s, request_timeout_s  # app/deadlines.py

    @property
    def endpoints(self) -> list[str]:
        return PAIR_ENDPOINTS if self.lm.scores_pairs else ENDPOINTS

    def check_model(self, model: str | None, request: Request) -> None:
        header_timeout(request.headers.get(HEADER))  # a bad header is a 400 before any work
        if model is not None and model != self.model_id:
            raise ModelNotFound(f"model {model!r} is not served here; this server serves {self.model_id!r}")

    # ---- endpoints ----

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> dict:
        self.check_model(body.model, request)
        if self.lm.scores_pairs:
            raise InvalidRequest(f"{self.model_id} is a cross-encoder: it scores pairs of texts on "
                                 f"{', '.join(PAIR_ENDPOINTS)} and gives no embeddings", param="model",
                                 code="unsupported_endpoint")
        size = self._dimensions(body.dimensions)
        [rows] = await self.preparing.run(self.token_rows, [("input", body.inputs())], body.truncate_prompt_tokens)
        vectors = await self._embed(rows, "embeddings", request)
        if size != self.lm.dimensions:  # a Matryoshka prefix, renormalised if the model's vectors are unit length
            vectors = vectors[:, :size]
            if self.lm.config.normalize:
                vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
        data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, body.encoding_format)}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": self.model_id, "usage": usage(rows)}

    async def rerank(self, body: RerankRequest, request: Request) -> dict:
        self.check_model(body.model, request)
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
        self.check_model(body.model, request)
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
            [rows] = await self.preparing.run(self.token_rows, [(params[1], list(zip(firsts, second)))], truncate)
            return (await self._embed(rows, endpoint, request))[:, 0].tolist(), rows
        rows_1, rows_2 = await self.preparing.run(self.token_rows, list(zip(params, (first, second))), truncate)
        vectors = await self._embed(rows_1 + rows_2, endpoint, request)
        left = vectors[:len(first)].expand(len(second), -1) if len(first) == 1 else vectors[:len(first)]
        return torch.nn.functional.cosine_similarity(left, vectors[len(first):], dim=1).tolist(), rows_1 + rows_2

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

    def token_rows(self, sides: list[tuple[str, list[str | list[int] | tuple[str, str]]]],
                   truncate: int | None) -> list[list[list[int]]]:
        """Each side's inputs (named by its field) -> token rows: texts with the model's special tokens, token-id
        lists as given, a cross-encoder's (first, second) pairs tokenized together; every limit checked, over all
        sides together. Runs on a prepare worker: tokenizing 2,048 texts is not the event loop's work."""
        limit = self.lm.max_context
        for param, inputs in sides:
            if not inputs:
                raise InvalidRequest(f"`{param}` is empty; give at least one input", param=param)
        if (count := sum(len(inputs) for _, inputs in sides)) > MAX_INPUTS:
            names = " and ".join(f"`{param}`" for param, _ in sides)
            raise InvalidRequest(f"{names} {'hold' if len(sides) > 1 else 'has'} {count:,} inputs"
                                 f"{' together' if len(sides) > 1 else ''}; at most {MAX_INPUTS:,} are accepted per "
                                 "request (MAX_INPUTS)", param=sides[-1][0], code="too_many_items")
        if truncate is not None and not (truncate == -1 or truncate >= 1):
            raise InvalidRequest("`truncate_prompt_tokens` must be -1 (the model's limit) or at least 1",
                                 param="truncate_prompt_tokens")
        if truncate is not None and truncate > limit:
            raise InvalidRequest(f"`truncate_prompt_tokens` is {truncate}; {self.model_id} takes at most {limit} "
                                 "tokens per input", param="truncate_prompt_tokens")
        keep = None if truncate is None else (limit if truncate == -1 else truncate)
        total, out = 0, []
        for param, inputs in sides:
            rows = []
            for i, item in enumerate(inputs):
                where = f"{param}[{i}]" if len(inputs) > 1 else param
                row = self._row(item, keep, where, param)
                if len(row) > limit:
                    raise InvalidRequest(f"`{where}` has {len(row):,} tokens; {self.model_id} takes at most "
                                         f"{limit} per input (set `truncate_prompt_tokens` to cut longer inputs)",
                                         param=param, code="context_length_exceeded")
                total += len(row)
                if total > MAX_TOTAL_TOKENS:
                    raise InvalidRequest(f"`{param}` brings the request past {MAX_TOTAL_TOKENS:,} tokens in all"
                                         f"{' (every side counted)' if len(sides) > 1 else ''}, the most one "
                                         "request may (MAX_TOTAL_TOKENS); split it", param=param,
                                         code="too_many_tokens")
                rows.append(row)
            out.append(rows)
        return out

    def _row(self, item: str | list[int] | tuple[str, str], keep: int | None, where: str, param: str) -> list[int]:
        if isinstance(item, tuple):  # a cross-encoder's (first, second) pair
            if not item[0] or not item[1]:
                raise InvalidRequest(f"`{where}` pairs an empty string; every text needs words", param=param)
            try:
                return self.lm.encode_pair(*item, keep)
            except ValueError as err:  # a cut too short for the pair's special tokens and both texts
                raise InvalidRequest(f"`truncate_prompt_tokens`: {err}", param="truncate_prompt_tokens") from None
        if isinstance(item, str):
            if not item:
                raise InvalidRequest(f"`{where}` is an empty string; every input needs text", param=param)
            return self.lm.encode_text(item, keep)
        if not item:
            raise InvalidRequest(f"`{where}` is an empty token list", param=param)
        if bad := [t for t in item if t >= self.lm.vocab_size]:
            raise InvalidRequest(f"`{where}` has token ids outside the vocabulary: {bad[:5]}", param=param)
        return list(item) if keep is None else self.lm.cut_ids(item, keep)

    async def _embed(self, rows: list[list[int]], endpoint: str, request: Request) -> torch.Tensor:
        tokens = sum(len(r) for r in rows)
        request.state.prompt_tokens = tokens  # the access log's `prompt=`
        background = getattr(request.state, "background", False)  # a batch line (app/entry.py): no queue limit
        deadlines = (None, None) if background else request_deadlines(
            request.headers.get(HEADER), getattr(request.state, "arrived", None), self.queue_timeout_s,
            self.request_timeout_s)
        vectors = torch.stack(await self.engine.embed(rows, deadlines, background))  # [rows, H]
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
