"""Constrained decoding: a grammar masks, row by row, the tokens that cannot continue a valid document.

The grammar engine is xgrammar (chosen over llguidance by measurement on Qwen's 151,936-token vocabulary; figures
in docs/tools-and-structured-outputs.md). `Grammars` compiles a JSON schema or a structural tag once per distinct
spec (an LRU cache) against this model's tokenizer, in a worker process with a deadline
(app/structured/grammar_compile.py), once app/structured/schema_check.py has refused what it would not enforce or what costs
too much to compile. Compiles are queued per client and served in turn (app/structured/fair_queue.py), with at most
`GrammarLimits.per_client` of one client's running or waiting, so one client's costly schemas delay only its own.
`Grammar.matcher()` gives each sequence its own `GrammarMatcher`, which every step:
  1) writes the allowed tokens into a bitmask (one bit per token id) and applies it to that row's logits;
  2) after the token is chosen, advances its state with it.

Rows without a grammar never reach this module, so they pay nothing. A greedy row on a CPU skips step 1's apply
when the model's own best token is allowed, which it mostly is (see `Sequence.pick`). The bitmask is sized from the
model's config vocabulary (Qwen: 151,936), which is larger than the tokenizer's (151,665): xgrammar treats the padding
ids as special tokens, so they stay masked. The stop tokens given to `Grammars` (the model's EOS ids) are the only
tokens allowed once a document is complete, so EOS ends a complete document and nothing else. Whitespace between
JSON tokens is capped (`MAX_WHITESPACE`), so a model cannot pad with spaces until max_tokens (vLLM 38696).

Whatever checking or compiling a constraint raises beyond the refusals written for it (a checker's bug, a library's
surprise) is a 400 naming the field it came in (`refusing_as_invalid`), logged with its traceback: a hostile
constraint can fail its own request, never answer a 500. A compile worker that cannot start is the server's fault and
stays a 500.

This module knows JSON Schema but nothing of OpenAI: what to constrain is decided in app/openai/.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Iterator, Sequence

import torch

from app.structured.fair_queue import FairQueue
from app.structured.grammar_compile import (CompileFailed, CompileOutOfMemory, CompilePool, CompileTimeout,
                                                 WorkerFailed)
from app.structured.schema_check import GrammarLimits, check_schema, pattern_repeat
from app.errors import InvalidRequest, Overloaded, ServeError

log = logging.getLogger("app.structured.grammars")

MAX_WHITESPACE = 4  # at most this many whitespace characters in a row between JSON tokens
CACHE_SIZE = 128  # compiled grammars kept; a compiled JSON schema is tens of KB to a few MB
MAX_CONSTRAINT_CHARS = 65536  # a request's regex or EBNF grammar
CACHE_BYTES = 256 * 2**20  # and at most this much of them (xgrammar's own count of a compiled grammar's memory)


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar, shared by every sequence that uses it; each sequence gets its own matcher."""

    compiled: Any  # xgrammar.CompiledGrammar
    vocab_size: int
    description: str  # for the x-sampling-params header: "json_schema", "structural_tag", ...
    param: str = "response_format"  # the request field it came from, named when it reaches a dead end

    def matcher(self) -> "GrammarMatcher":
        return GrammarMatcher(self)


class GrammarMatcher:
    """One sequence's position in its grammar, and a preallocated one-row bitmask."""

    def __init__(self, grammar: Grammar):
        import xgrammar as xgr

        self._xgr = xgr
        self.grammar = grammar
        self.matcher = xgr.GrammarMatcher(grammar.compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, grammar.vocab_size)  # int32 [1, ceil(vocab / 32)], CPU

    def fill(self) -> None:
        """Work out which tokens may come next (into the bitmask); call once per step, before allows() or apply()."""
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)

    def allows(self, token_id: int) -> bool:
        """Whether the grammar allows this token next (after fill()): one bit, no pass over the vocabulary."""
        return bool((int(self.bitmask[0, token_id >> 5]) >> (token_id & 31)) & 1)

    @property
    def dead_end(self) -> bool:
        """No token may come next (after fill()): a pattern that matches nothing, say `[^\\s\\S]`. A complete
        document always allows the stop tokens, so a dead end is never a finished answer."""
        return not bool(self.bitmask.any())

    def dead_end_error(self, generated: int) -> InvalidRequest:
        return InvalidRequest(f"the grammar of `{self.grammar.param}` allows no token after {generated} generated "
                              "tokens: no text can satisfy it from here (a pattern or enum that matches nothing?)",
                              param=self.grammar.param, code="grammar_dead_end")

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [1, vocab] -> a copy where every token the grammar forbids is -inf."""
        self.fill()
        return self.apply(logits)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Like mask(), with the bitmask fill() left. Applying it is the expensive part on a CPU: about 1 ms for
        151,936 ids, as each id's bit decides a branch."""
        masked = logits.clone()
        bitmask = self.bitmask if logits.device.type == "cpu" else self.bitmask.to(logits.device, non_blocking=True)
        self._xgr.apply_token_bitmask_inplace(masked, bitmask)
        return masked

    def accept(self, token_id: int) -> bool:
        """Advance with the chosen token; False if the grammar rejects it (it never should after `mask`)."""
        return self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        """The document is complete and a stop token was accepted."""
        return self.matcher.is_terminated()


class Grammars:
    """Compiles grammars for one model's tokenizer, caching them by tenant and spec. Thread-safe.

    The cache and the sharing of compiles in flight are per tenant (the API key's, where the prefix cache is salted
    by key; None is one namespace of its own, as in app/core/engine/prefix_cache.py): a shared cache answered a
    schema another tenant had used in a dict lookup, and a new one in tens of ms to seconds, so a tenant could tell
    by the latency which schemas others had sent. Each tenant's first use of a schema compiles it.

    A compile runs in a worker process with a deadline (app/structured/grammar_compile.py), reached from this object's
    own threads: never the event loop, nor the thread pool that tokenization uses. `json_schema_async` and
    `structural_tag_async` are for the event loop; the plain methods block (tests, benches). The first compile
    also builds the tokenizer's tables (about 1 s for Qwen's vocabulary) and starts a worker (about 3 s)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int], cache_size: int = CACHE_SIZE,
                 limits: GrammarLimits = GrammarLimits(), cache_bytes: int = CACHE_BYTES):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.limits = limits
        self._info = None  # xgrammar.TokenizerInfo, built on first use
        self._workers: CompilePool | None = None
        self._threads = FairQueue(limits.workers, name="grammar")
        # (tenant, spec, param) -> its compile, until it is done
        self._compiling: dict[tuple[str | None, str, str], Future] = {}
        self._per_client: dict[str, int] = {}  # client -> its compiles running or waiting
        self._cache: OrderedDict[tuple[str | None, str], Grammar] = OrderedDict()  # (tenant, spec) -> its grammar
        self.compiles = 0  # compiles sent to a worker (cache misses), for tests and the curious
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()

    def json_schema(self, schema: dict[str, Any], param: str = "response_format",
                    tenant: str | None = None) -> Grammar:
        with refusing_as_invalid(param):
            check_schema(schema, param, limits=self.limits)
            return self._compile("json_schema", schema, param, tenant)

    def structural_tag(self, tag: dict[str, Any], param: str = "tool_choice", tenant: str | None = None) -> Grammar:
        """A structural tag (xgrammar's format for "these literal strings around JSON of these schemas"); the
        schemas inside it are checked by whoever builds it (app/openai/structured.py)."""
        with refusing_as_invalid(param):
            return self._compile("structural_tag", tag, param, tenant)

    def regex(self, pattern: str, param: str = "structured_outputs.regex", tenant: str | None = None) -> Grammar:
        with refusing_as_invalid(param):
            check_text("regex", pattern, param, self.limits)
            return self._compile("regex", pattern, param, tenant)

    def grammar(self, ebnf: str, param: str = "structured_outputs.grammar", tenant: str | None = None) -> Grammar:
        """An EBNF grammar as xgrammar reads it (llama.cpp's GBNF is the same notation), starting at `root`."""
        with refusing_as_invalid(param):
            check_text("grammar", ebnf, param, self.limits)
            return self._compile("grammar", ebnf, param, tenant)

    # `client`: whose compile this is (the HTTP layer decides what a client is); compiles are bounded and served
    # in turn per client. `tenant`: whose cache it is (see the class).
    async def text_async(self, kind: str, text: str, param: str, client: str = "",
                         tenant: str | None = None) -> Grammar:
        """A regular expression (`kind` "regex") or an EBNF grammar ("grammar"), as the plain methods, for the event
        loop: checked, looked up and compiled off it, in turn per client."""
        return await self._compile_async(kind, text, param, check=True, client=client, tenant=tenant)

    async def json_schema_async(self, schema: dict[str, Any], param: str = "response_format", client: str = "",
                                tenant: str | None = None) -> Grammar:
        return await self._compile_async("json_schema", schema, param, check=True, client=client, tenant=tenant)

    async def structural_tag_async(self, tag: dict[str, Any], param: str = "tool_choice", client: str = "",
                                   tenant: str | None = None) -> Grammar:
        return await self._compile_async("structural_tag", tag, param, check=False, client=client,
                                         tenant=tenant)

    async def _compile_async(self, kind: str, spec: dict[str, Any] | str, param: str, check: bool, client: str,
                             tenant: str | None) -> Grammar:
        def lookup() -> tuple[str, Grammar | None]:  # a walk over the schema: cheap, but not for the event loop
            if check and kind == "json_schema":
                check_schema(spec, param, limits=self.limits)
            elif check:
                check_text(kind, spec, param, self.limits)
            key = self._key(kind, spec)
            return key, self._lookup(tenant, key, param)

        with refusing_as_invalid(param):
            key, grammar = await asyncio.to_thread(lookup)
            if grammar is not None:  # a cached grammar never waits behind compiles
                return grammar
            entry = (tenant, key, param)
            with self._lock:
                future = self._compiling.get(entry)  # the same spec asked for again while it compiles: share it
                if future is None:
                    if (mine := self._per_client.get(client, 0)) >= self.limits.per_client:
                        raise Overloaded(f"{mine} of your grammars are compiling or waiting to; retry when they are "
                                         "done (GRAMMAR_COMPILE_PER_CLIENT)", retry_after_s=2)
                    if len(self._compiling) >= self.limits.workers + self.limits.queue:
                        raise Overloaded(f"{len(self._compiling)} grammars are compiling or waiting to; retry "
                                         "shortly (GRAMMAR_COMPILE_QUEUE)", retry_after_s=2)
                    future = self._threads.submit(client, self._compile, kind, spec, param, tenant, key)
                    self._compiling[entry] = future
                    self._per_client[client] = mine + 1
                    future.add_done_callback(lambda _: self._compile_done(entry, client))
            # shield: a caller that leaves must not cancel a compile that others wait for, or that will be cached
            return await asyncio.shield(asyncio.wrap_future(future))

    def _compile_done(self, entry: tuple[str | None, str, str], client: str) -> None:
        with self._lock:
            self._compiling.pop(entry, None)
            if (left := self._per_client.pop(client, 0) - 1) > 0:
                self._per_client[client] = left

    @staticmethod
    def _key(kind: str, spec: dict[str, Any] | str) -> str:
        # Exactly what is compiled: key order matters, since the grammar writes properties in the schema's order.
        return kind + ":" + json.dumps(spec, ensure_ascii=False)

    def _lookup(self, tenant: str | None, key: str, param: str) -> Grammar | None:
        with self._lock:
            grammar = self._cache.get((tenant, key))
            if grammar is None:
                return None
            self._cache.move_to_end((tenant, key))
        return grammar if grammar.param == param else replace(grammar, param=param)

    def _compile(self, kind: str, spec: dict[str, Any] | str, param: str, tenant: str | None = None,
                 key: str | None = None) -> Grammar:
        import xgrammar as xgr

        key = key or self._key(kind, spec)
        if (grammar := self._lookup(tenant, key, param)) is not None:
            return grammar
        self._start_workers()
        request = {"kind": kind, "spec": key.split(":", 1)[1], "max_whitespace": MAX_WHITESPACE}
        what = {"grammar": "EBNF grammar"}.get(kind, kind.replace("_", " "))
        with self._lock:
            self.compiles += 1
        try:
            compiled = xgr.CompiledGrammar.deserialize_json(
                self._workers.compile(request, self.limits.compile_timeout_s), self._info)
        except CompileTimeout:
            raise InvalidRequest(f"the {what} in `{param}` took longer than {self.limits.compile_timeout_s:g} s to "
                                 "compile and was stopped; simplify it (GRAMMAR_COMPILE_TIMEOUT_S)", param=param,
                                 code="grammar_too_complex") from None
        except CompileOutOfMemory:
            raise InvalidRequest(f"the {what} in `{param}` needed more than {self.limits.memory_bytes / 2**20:,.0f} "
                                 "MiB to compile and was stopped; simplify it (GRAMMAR_COMPILE_MEMORY_BYTES)",
                                 param=param, code="grammar_too_complex") from None
        except CompileFailed as err:
            raise InvalidRequest(f"cannot build a grammar from the {what} in `{param}`: {library_message(err)}",
                                 param=param) from None
        except WorkerFailed as err:
            raise ServeError(f"the grammar compile worker failed: {err}", code="grammar_worker_failed") from None
        grammar = Grammar(compiled, self.vocab_size, kind, param)
        with self._lock:
            self._cache[(tenant, key)] = grammar
            while len(self._cache) > self.cache_size or (
                    len(self._cache) > 1 and sum(g.compiled.memory_size_bytes for g in self._cache.values())
                    > self.cache_bytes):
                self._cache.popitem(last=False)
        return grammar

    def _start_workers(self) -> None:
        """The tokenizer's tables and the worker pool, once. A failure here is the server's, not the request's."""
        import xgrammar as xgr

        with self._start_lock:  # not self._lock: the event loop takes that one, and this can take a second
            if self._workers is not None:
                return
            try:
                self._info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                                stop_token_ids=self.stop_ids)
            except Exception as err:  # noqa: BLE001 - the tokenizer's, whatever it is: logged, and a 500
                log.exception("cannot build the grammar tables of this tokenizer")
                raise ServeError(f"cannot build the grammar tables of this tokenizer: {type(err).__name__}",
                                 code="grammar_worker_failed") from None
            self._workers = CompilePool(self._info.serialize_json(), self.limits.workers, self.limits.memory_bytes)

    def close(self) -> None:
        self._threads.shutdown()
        if self._workers is not None:
            self._workers.close()


@contextmanager
def refusing_as_invalid(param: str) -> Iterator[None]:
    """The one boundary between a request's constraint and the server: an exception nobody wrote a refusal for,
    raised while checking or compiling the constraint in `param`, is a 400 naming that field (the constraint caused
    it), logged with its traceback (the checker, or the library, has a bug to fix). The refusals already written
    (ServeError: 400s, 429s) and cancellation pass through as they are."""
    try:
        yield
    except ServeError:
        raise
    except Exception as err:  # noqa: BLE001 - that is the point: whatever it is
        log.warning("checking or compiling the constraint in `%s` raised %s", param, type(err).__name__,
                    exc_info=True)
        raise InvalidRequest(f"the constraint in `{param}` could not be checked or compiled; check its syntax and "
                             "simplify it", param=param) from None


def check_text(kind: str, text: str, param: str, limits: GrammarLimits) -> None:
    """Refuse a regex or grammar that is empty, longer than MAX_CONSTRAINT_CHARS, or (a regex) repeats a piece more
    often than a JSON schema's pattern may: what the compile would spend before its deadline stopped it."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequest(f"the {kind} in `{param}` is empty", param=param)
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequest(f"the {kind} in `{param}` has {len(text):,} characters; at most {MAX_CONSTRAINT_CHARS:,}",
                             param=param, code="grammar_too_complex")
    if kind == "regex" and (repeat := pattern_repeat(text)) > limits.max_repeat:
        raise InvalidRequest(f"the regex in `{param}` repeats up to {repeat:,} times; at most {limits.max_repeat:,} "
                             "(GRAMMAR_MAX_REPEAT), counting nested repetitions multiplied", param=param,
                             code="grammar_too_complex")


def library_message(err: Exception) -> str:
    """The grammar library's reason, without its source path and timestamp (`[12:00:00] /src/x.cc:42: ...`)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    message = _LIBRARY_PREFIX.sub("", lines[-1]) if lines else ""
    return message or "the grammar library refused it"


_LIBRARY_PREFIX = re.compile(r"^(\[[\d:. ]+\]\s*)?(\S+\.(cc|cpp|h|py):\d+:\s*)?")
