"""Constrained decoding: a grammar masks, row by row, the tokens that cannot continue a valid document.

The grammar engine is xgrammar (chosen over llguidance by measurement on Qwen's 151,936-token vocabulary; figures
in docs/tools-and-structured-outputs.md). `Grammars` compiles a JSON schema or a structural tag once per distinct spec (an LRU cache) against
this model's tokenizer; `Grammar.matcher()` gives each sequence its own `GrammarMatcher`, which every step:
  1) writes the allowed tokens into a bitmask (one bit per token id) and applies it to that row's logits;
  2) after the token is chosen, advances its state with it.

Rows without a grammar never reach this module, so they pay nothing. A greedy row on a CPU skips step 1's apply
when the model's own best token is allowed, which it mostly is (see `Sequence.pick`). The bitmask is sized from the
model's config vocabulary (Qwen: 151,936), which is larger than the tokenizer's (151,665): xgrammar treats the padding
ids as special tokens, so they stay masked. The stop tokens given to `Grammars` (the model's EOS ids) are the only
tokens allowed once a document is complete, so EOS ends a complete document and nothing else. Whitespace between
JSON tokens is capped (`MAX_WHITESPACE`), so a model cannot pad with spaces until max_tokens (vLLM 38696).

This module knows JSON Schema but nothing of OpenAI: what to constrain is decided in app/openai/.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from app.errors import InvalidRequest

MAX_WHITESPACE = 4  # at most this many whitespace characters in a row between JSON tokens
CACHE_SIZE = 128  # compiled grammars kept; a compiled JSON schema is tens of KB

# JSON Schema keywords the engine enforces, or that only annotate; anything else is refused with a 400, never
# silently ignored (xgrammar warns and ignores `not`, `if`, multi-entry `allOf`, unknown formats, ...).
ENFORCED = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "uniqueItems", "contains", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "minProperties", "maxProperties", "propertyNames", "patternProperties", "dependentRequired",
    "unevaluatedProperties", "unevaluatedItems",
}
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "strict", "nullable", "discriminator", "contentMediaType"}
FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uri", "uri-reference",
           "uri-template", "json-pointer", "relative-json-pointer", "uuid"}
# Keywords whose value is a map of name -> subschema, or a list of subschemas, or one subschema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedProperties",
               "unevaluatedItems")


def check_schema(schema: Any, param: str, path: str = "") -> None:
    """Refuse a JSON schema the engine would not fully enforce, naming the keyword and where it is."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidRequest(f"a JSON schema must be an object, got {type(schema).__name__} at {path or '/'}",
                             param=param)
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key not in ENFORCED and key not in ANNOTATIONS:
            raise InvalidRequest(f"JSON schema keyword {key!r} (at {where}) cannot be enforced by this server",
                                 param=param)
        if key == "format" and value not in FORMATS:
            raise InvalidRequest(f"JSON schema format {value!r} (at {where}) cannot be enforced by this server; "
                                 f"supported: {', '.join(sorted(FORMATS))}", param=param)
        if key == "pattern" and ("minLength" in schema or "maxLength" in schema):
            raise InvalidRequest(f"JSON schema keyword 'pattern' together with minLength/maxLength (at {where}) "
                                 "cannot be enforced by this server; put the length into the pattern", param=param)
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise InvalidRequest(f"JSON schema keyword 'allOf' with more than one schema (at {where}) cannot be "
                                 "enforced by this server", param=param)
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, param, f"{where}/{name}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, param, f"{where}/{i}")
        elif key in _SCHEMA_ONE:
            check_schema(value, param, where)


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar, shared by every sequence that uses it; each sequence gets its own matcher."""

    compiled: Any  # xgrammar.CompiledGrammar
    vocab_size: int
    description: str  # for the x-sampling-params header: "json_schema", "structural_tag", ...

    def matcher(self) -> "GrammarMatcher":
        return GrammarMatcher(self)


class GrammarMatcher:
    """One sequence's position in its grammar, and a preallocated one-row bitmask."""

    def __init__(self, grammar: Grammar):
        import xgrammar as xgr

        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(grammar.compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, grammar.vocab_size)  # int32 [1, ceil(vocab / 32)], CPU

    def fill(self) -> None:
        """Work out which tokens may come next (into the bitmask); call once per step, before allows() or apply()."""
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)

    def allows(self, token_id: int) -> bool:
        """Whether the grammar allows this token next (after fill()): one bit, no pass over the vocabulary."""
        return bool((int(self.bitmask[0, token_id >> 5]) >> (token_id & 31)) & 1)

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
    """Compiles grammars for one model's tokenizer, caching them by spec. Thread-safe; compile off the event loop
    (the first call also builds the tokenizer's tables: about 1 s for Qwen's vocabulary)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int], cache_size: int = CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        self.cache_size = cache_size
        self._compiler = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def _get_compiler(self):
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_ids)
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # we cache, with a bound
            return self._compiler

    def json_schema(self, schema: dict[str, Any], param: str = "response_format") -> Grammar:
        check_schema(schema, param)
        return self._cached("json_schema", schema, param, lambda c, spec: c.compile_json_schema(
            spec, any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE, strict_mode=False))

    def structural_tag(self, tag: dict[str, Any], param: str = "tool_choice") -> Grammar:
        """A structural tag (xgrammar's format for "these literal strings around JSON of these schemas")."""
        return self._cached("structural_tag", tag, param, lambda c, spec: c.compile_structural_tag(spec))

    def _cached(self, kind: str, spec: dict[str, Any], param: str, compile_fn) -> Grammar:
        key = kind + ":" + json.dumps(spec, sort_keys=True, ensure_ascii=False)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiler = self._get_compiler()
        try:
            compiled = compile_fn(compiler, json.dumps(spec, ensure_ascii=False))
        except Exception as err:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError for schemas it refuses
            message = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            raise InvalidRequest(f"cannot build a grammar from this {kind.replace('_', ' ')}: {message}",
                                 param=param) from err
        grammar = Grammar(compiled, self.vocab_size, kind)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar
