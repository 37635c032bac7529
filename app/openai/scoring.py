"""Prompt logprobs on the wire: `echo` with `logprobs` (the legacy completions shape that evaluation harnesses read)
and vLLM's `prompt_logprobs` extension.

The engine scores the prompt from its own prefill pass (`Sequence.score_prompt`) and hands the result over with
the first token event; this module only lays it out. In the legacy shape the prompt's tokens come first, each with
its logprob and top alternatives (the first token's are null: nothing came before it), then the answer's, and
`text_offset` counts characters through both, across a stream's chunks as in the whole answer.

Laying it out is what costs: a 3,200-token prompt scored with 20 alternatives and `n` 8 was half a million
entries, each decoded to a string, in two shapes, then tens of MB of JSON, all on the event loop, and each of the
`n` choices had scored the whole prompt again in the engine. So: one choice scores the prompt and the others reuse
its scores (`PromptScores`); they are formatted once per request, each distinct token id decoded once, on a prepare
worker; the JSON that carries them is written there too, in pieces (`json_text`); and prompt tokens x (alternatives
+ 1) x choices is bounded by `MAX_PROMPT_LOGPROB_ENTRIES` (`check_prompt_scores`), a 400 before anything runs.
A deadline that cuts the prompt's prefill leaves no scores: the answer then carries none (`logprobs` and
`prompt_logprobs` null, no echoed prompt), as any answer cut before its first token, never a score that looks whole.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from app.core.sequence import PromptLogprob
from app.errors import InvalidRequest

JSON_PIECE = 64  # list items per json.dumps call: the C encoder holds the GIL for a whole call (see json_text)


def check_prompt_scores(prompt_tokens: int, top: int | None, n: int, limit: int, param: str) -> None:
    """A 400 naming `param` when scoring this prompt would lay out more than `limit` entries."""
    if top is None:
        return
    entries = prompt_tokens * (top + 1) * n
    if entries > limit:
        raise InvalidRequest(f"scoring this prompt returns {prompt_tokens} tokens x {top + 1} logprobs each x {n} "
                             f"choices = {entries:,} entries, more than this server lays out for one request "
                             f"(MAX_PROMPT_LOGPROB_ENTRIES, {limit:,}); ask fewer alternatives, fewer choices or a "
                             "shorter prompt", param=param, code="too_many_items")


@dataclass
class PromptScores:
    """One request's prompt scores, laid out once for all its choices: `entries` in the legacy shape (echo with
    logprobs), `vllm` in vLLM's; None where not asked for."""

    entries: list[dict[str, Any]] | None = None
    vllm: list[dict[str, Any] | None] | None = None
    columns: dict[str, list] | None = None  # `entries` in the legacy column layout, laid out once for every choice


def format_prompt_scores(tokenizer, prompt_ids: list[int], scored: list[PromptLogprob], legacy: bool,
                         vllm: bool) -> PromptScores:
    """Both layouts from the engine's scores; each distinct token decoded once (a prompt's alternatives repeat)."""
    texts: dict[int, str] = {}

    def text(token_id: int) -> str:
        if token_id not in texts:
            texts[token_id] = tokenizer.decode([token_id])
        return texts[token_id]

    scores = PromptScores()
    if legacy:
        scores.entries = [{"token": text(prompt_ids[0]), "logprob": None, "top_logprobs": None}]
        for i, e in enumerate(scored):
            scores.entries.append({"token": text(e.token_id), "logprob": e.logprob,
                                   "top_logprobs": [{"token": text(t), "logprob": lp} for t, lp in e.top]})
            let_the_loop_in(i)
        scores.columns = legacy_logprobs(scores.entries)
    if vllm:
        scores.vllm = [None]
        for i, e in enumerate(scored):
            ranked = {e.token_id: (e.logprob, e.rank)}
            for rank, (token_id, logprob) in enumerate(e.top, start=1):
                ranked.setdefault(token_id, (logprob, rank))
            scores.vllm.append({str(t): {"logprob": lp, "rank": rank, "decoded_token": text(t)}
                                for t, (lp, rank) in ranked.items()})
            let_the_loop_in(i)
    return scores


def let_the_loop_in(i: int) -> None:
    """Every JSON_PIECE positions, hand the GIL over. A thread that never waits keeps it for the interpreter's
    switch interval (5 ms) whenever the event loop asks for it back, and the loop asks after every wait for the
    network, so a probe's few turns of the loop each waited 5 ms or more behind this work. `time.sleep(0)` releases
    it at once. With four long scored requests at once (tests/server/test_prompt_logprob_flood.py), /health's p99
    was 269 ms without it (load 8 on the shared 2 cores) and 107 ms with it (load 5), one run each."""
    if i % JSON_PIECE == JSON_PIECE - 1:
        time.sleep(0)


def legacy_logprobs(entries: list[dict[str, Any]], start: int = 0) -> dict[str, Any]:
    """The legacy completions API's column layout; `start`: the character offset of the first entry's token."""
    offsets, position = [], start
    for e in entries:
        offsets.append(position)
        position += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for e in entries],
            "text_offset": offsets}


def json_text(value: Any, depth: int = 5) -> str:
    """`json.dumps(value, ensure_ascii=False)` with JSONResponse's separators, written in pieces: containers down to
    `depth` are walked and long lists dumped JSON_PIECE items at a time, so that no call holds the GIL for long. The
    answer of the module docstring (51 MB) took 10 s in one call on the shared 2-core machine, all of it with the GIL
    held; in pieces of 256 positions its longest call took 92 ms, so pieces of 64 positions hold it ~25 ms."""
    parts: list[str] = []

    def dumps(v: Any) -> str:
        return json.dumps(v, ensure_ascii=False, allow_nan=False, separators=(",", ":"))

    def walk(v: Any, level: int) -> None:
        if level < depth and isinstance(v, dict) and all(isinstance(k, str) for k in v):
            parts.append("{")
            for i, (k, item) in enumerate(v.items()):
                parts.append(("," if i else "") + dumps(k) + ":")
                walk(item, level + 1)
            parts.append("}")
        elif level < depth and isinstance(v, list) and v:
            parts.append("[")
            if len(v) > JSON_PIECE:
                for i in range(0, len(v), JSON_PIECE):
                    parts.append(("," if i else "") + dumps(v[i:i + JSON_PIECE])[1:-1])
                    let_the_loop_in(JSON_PIECE - 1)
            else:
                for i, item in enumerate(v):
                    parts.append("," if i else "")
                    walk(item, level + 1)
            parts.append("]")
        else:
            parts.append(dumps(v))

    walk(value, 0)
    return "".join(parts)


@dataclass
class Echo:
    """What a request asks back about its prompt: its text before the answer (`echo`, completions only), its
    scores in either layout, and whether nothing is generated (`max_tokens: 0`). The default asks for none of it:
    plain chat answers and completions. `scores` is set once, from the choice that scored the prompt."""

    prompt_ids: list[int] = field(default_factory=list)
    text: str | None = None  # the prompt as echoed; None: no echo
    score_only: bool = False
    legacy: bool = False  # the echoed prompt carries logprobs (echo with logprobs)
    vllm: bool = False  # vLLM's prompt_logprobs
    scores: PromptScores | None = None  # None until laid out, or when a deadline cut the prompt's scoring
    laid_out: bool = False
    offsets: dict[int, int] = field(default_factory=dict)  # per choice: text_offset of its next entry

    @classmethod
    def of(cls, body, prompt: str | list[int] | None, prompt_ids: list[int], tokenizer, chat: bool) -> "Echo":
        echo = not chat and body.echo
        text = (prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)) if echo else None
        return cls(prompt_ids, text, not chat and body.score_only, echo and body.logprobs is not None,
                   body.prompt_logprobs is not None)

    @property
    def asked(self) -> bool:
        return self.legacy or self.vllm

    @property
    def missing(self) -> bool:
        """Scores were asked for and the prompt was never scored (a deadline during its prefill)."""
        return self.asked and self.laid_out and self.scores is None

    def lay_out(self, tokenizer, scored: list[PromptLogprob] | None) -> None:
        """On a prepare worker: the scoring choice's first event has come (`scored` None: it never scored)."""
        if scored is not None:
            self.scores = format_prompt_scores(tokenizer, self.prompt_ids, scored, self.legacy, self.vllm)
        self.laid_out = True

    def vllm_scores(self) -> list[dict[str, Any] | None] | None:
        return self.scores.vllm if self.scores is not None else None

    def finish_reason(self, reason: str | None) -> str | None:
        """A scored prompt's answer ends for "length" (it may generate nothing), unless a deadline ended it first."""
        return "length" if self.score_only and reason not in (None, "timeout") else reason

    def text_and_logprobs(self, choice, text: str, entries: list[dict[str, Any]],
                          with_prompt: bool = True) -> tuple[str, dict[str, Any] | None]:
        """A completion choice's `text` and legacy `logprobs` (None unless asked for): the answer's, after the
        prompt's when it is echoed (`with_prompt`: in a stream, the first chunk only). Offsets run on from the
        choice's previous chunk."""
        if self.score_only:  # the one token picked from the prefill's logits is not part of the answer
            text, entries = "", []
        if self.missing:  # no score that looks like one: neither the prompt nor any logprobs
            return text, None
        prompt = None
        if self.text is not None and with_prompt:
            text = self.text + text
            if self.legacy:
                prompt = self.scores.columns
                self.offsets[choice.index] = sum(len(e["token"]) for e in self.scores.entries)
        if not choice.handle.params.logprobs:
            return text, None
        start = self.offsets.get(choice.index, 0)
        columns = legacy_logprobs(entries, start)
        self.offsets[choice.index] = start + sum(len(e["token"]) for e in entries)
        if prompt is not None:  # new lists: the prompt's columns are shared by every choice
            columns = {name: prompt[name] + values for name, values in columns.items()}
        return text, columns
