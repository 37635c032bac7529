"""BATCH_INVARIANT's attention: every attention call a request's rows take is fixed by the request alone.

The packed pass (app/core/runner/packed.py) normally attends by what the step holds: the decode rows share one call
over their keys padded to the longest row's width, and a prefill chunk is one call over however many tokens the
step gave it. Either way a row's numbers depend on its neighbours: SDPA's result for a query row changes with the
call's query and key lengths (measured on this CPU: chunks of 1, 32, 100, 300, 700 against 128 all differ, by
~1e-6 in fp32 and ~1e-3 in bf16), and so does a matmul's over a padded width. With BATCH_INVARIANT on, the pass
instead cuts each request's rows into calls that depend only on absolute positions:

    prefill rows   query rows [16j, 16j + 16) of the prompt (the last piece ends at the prompt's end), keys from
                   the first position up to that piece's end: the same calls whatever the chunk, since the engine
                   ends chunks on multiples of PIECE (app/core/engine/step.py) and prefix-cache hits are whole
                   blocks of PIECE tokens
    decode rows    one query row over its own keys, no padding: one call per request
    verify rows    (n-gram drafts, app/core/speculative.py) each a row of its own, exactly as the decode row at
                   that position computes it, so a verified token is the one plain decoding gives

A sliding-window layer's call takes only the keys its window shows (the last `window` keys for a row), so its
shape too depends on positions alone. Where a piece's queries lie in an image run whose tokens see each other both
ways (Gemma 3, app/core/runner/image_groups.py), its keys run on to the run's end: the request's own runs, so the
call is still fixed by the request alone (and the engine never ends a chunk inside a run). The calls' keys are
contiguous copies: a slice of a longer cache has other strides, which a kernel may handle in another order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

PIECE = 16  # tokens per prefill piece: the prefix cache's block size, so a hit always ends where a piece does


@dataclass(frozen=True)
class Call:
    """One attention call: `rows` of the packed pass, the query positions [first, end) of request `span`."""

    span: int
    rows: slice
    first: int
    end: int
    as_decode: bool  # one generated row (decode or verify): no mask, its window applied by cutting its keys
    groups: tuple = ()  # image runs its queries lie in (Gemma 3), as offsets (first, end) from `first`
    ahead: int = 0  # keys after `end` its queries see: up to the end of those runs


def invariant_calls(spans: list[tuple[int, int]], starts: list[int], prefill: list[bool],
                    groups: list[tuple] | None = None) -> list[Call]:
    """The calls for a pass: `spans` each request's rows in the packed pass, `starts` its first absolute position,
    `prefill` whether it feeds prompt tokens (else its newest token and any drafts), `groups` the image runs its
    chunk feeds whose tokens see each other both ways, as offsets from its first position."""
    calls = []
    for i, ((row, row_end), first, prompt) in enumerate(zip(spans, starts, prefill)):
        runs = [(first + a, first + b) for a, b in (groups[i] if groups else ())]  # absolute positions
        end = first + row_end - row
        if not prompt:
            calls += [Call(i, slice(row + k, row + k + 1), first + k, first + k + 1, True) for k in range(end - first)]
            continue
        a = first
        while a < end:  # pieces at absolute multiples of PIECE (a chunk that starts off one is correct, not invariant)
            b = min(end, (a // PIECE + 1) * PIECE)
            inside = tuple((x - a, y - a) for x, y in runs if x < b and y > a)
            ahead = max([0] + [a + y - b for _, y in inside])
            calls.append(Call(i, slice(row + a - first, row + b - first), a, b, False, inside, ahead))
            a = b
    return calls


def call_keys(call: Call, span_end: int, n_keys: int, window: int | None) -> slice:
    """Which of the request's `n_keys` keys (they end at absolute position `span_end`) this call attends to: from
    position 0, or the window's first position the call's first query sees, up to the call's last query (or the
    end of the image runs its queries lie in)."""
    offset = span_end - n_keys  # the absolute position of key 0 (a sliding layer's cache keeps only its window)
    low = 0 if window is None else max(0, call.first - window + 1)
    return slice(max(low - offset, 0), call.end + call.ahead - offset)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Call], torch.Tensor]


def attend_in_calls(calls: list[Call], starts: list[int], spans: list[tuple[int, int]], query: torch.Tensor,
                    keys: list[torch.Tensor], values: list[torch.Tensor], window: int | None,
                    attend: Attend) -> torch.Tensor:
    """query [1, heads, T_total, d]; keys/values [1, kv_heads, n_i, d] per request -> [1, T_total, heads, d_v].
    `attend(q, k, v, call)` runs one call: q [1, heads, n, d] -> [1, n, heads, d_v]."""
    out = query.new_empty(1, query.shape[2], query.shape[1], values[0].shape[-1])
    for call in calls:
        k, v = keys[call.span], values[call.span]
        span_end = starts[call.span] + spans[call.span][1] - spans[call.span][0]
        seen = call_keys(call, span_end, k.shape[-2], window)
        out[:, call.rows] = attend(query[:, :, call.rows], k[:, :, seen].contiguous(), v[:, :, seen].contiguous(),
                                   call)
    return out
