"""Prompt logprobs on the wire: `echo` with `logprobs` (the legacy completions shape that evaluation harnesses read)
and vLLM's `prompt_logprobs` extension.

The engine scores the prompt from its own prefill pass (`Sequence.score_prompt`) and hands the result over with
the first token event; this module only lays it out. In the legacy shape the prompt's tokens come first, each with
its logprob and top alternatives (the first token's are null: nothing came before it), then the answer's, and
`text_offset` counts characters through both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.core.sequence import PromptLogprob


def prompt_entries(tokenizer, prompt_ids: list[int], scored: list[PromptLogprob] | None) -> list[dict[str, Any]]:
    """Each prompt token as a legacy logprobs entry; `scored` holds tokens 1.. (token 0 has no logprob)."""
    entries = [{"token": tokenizer.decode([prompt_ids[0]]), "logprob": None, "top_logprobs": None}]
    for entry in scored or []:
        entries.append({"token": tokenizer.decode([entry.token_id]), "logprob": entry.logprob,
                        "top_logprobs": [{"token": tokenizer.decode([t]), "logprob": lp} for t, lp in entry.top]})
    return entries


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


def vllm_prompt_logprobs(tokenizer, scored: list[PromptLogprob] | None) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first None), its id and its alternatives' ids, each with
    `logprob`, `rank` (1: the model's own first choice) and `decoded_token`."""
    out: list[dict[str, Any] | None] = [None]
    for entry in scored or []:
        ranked = {entry.token_id: (entry.logprob, entry.rank)}
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            ranked.setdefault(token_id, (logprob, rank))
        out.append({str(t): {"logprob": lp, "rank": rank, "decoded_token": tokenizer.decode([t])}
                    for t, (lp, rank) in ranked.items()})
    return out


@dataclass
class Echo:
    """What a completion asks back about its prompt: its text before the answer (`echo`), and whether nothing is
    generated (`max_tokens: 0`). The default asks for neither: chat answers and plain completions."""

    prompt_ids: list[int] = field(default_factory=list)
    text: str | None = None  # the prompt as echoed; None: no echo
    score_only: bool = False
    tokenizer: Any = None

    @classmethod
    def of(cls, body, prompt: str | list[int], prompt_ids: list[int], tokenizer) -> "Echo":
        text = (prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)) if body.echo else None
        return cls(prompt_ids, text, body.score_only, tokenizer)

    def finish_reason(self, reason: str | None) -> str | None:
        """A scored prompt's answer ends for "length" (it may generate nothing), unless a deadline ended it first."""
        return "length" if self.score_only and reason not in (None, "timeout") else reason

    def text_and_logprobs(self, choice, text: str, entries: list[dict[str, Any]],
                          with_prompt: bool = True) -> tuple[str, dict[str, Any] | None]:
        """A completion choice's `text` and legacy `logprobs` (None unless asked for): the answer's, after the
        prompt's when it is echoed (`with_prompt`: in a stream, the first chunk only)."""
        if self.score_only:  # the one token picked from the prefill's logits is not part of the answer
            text, entries = "", []
        if self.text is not None and with_prompt:
            text = self.text + text
            if choice.handle.params.logprobs:
                entries = prompt_entries(self.tokenizer, self.prompt_ids, choice.prompt_logprobs) + entries
        return text, legacy_logprobs(entries) if choice.handle.params.logprobs else None
