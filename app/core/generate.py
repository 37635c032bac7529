"""The decode loop: the article's `simple_generate`, with a per-request KV cache, streaming events and stop rules.

    1) prefill: run the model body over the prompt once, filling this request's own DynamicCache,
       and make logits for the last position only (full-prompt logits would be prompt_len x vocab floats),
       as the model's own forward makes them (app/models/logits.py: lm_head, then any scaling or soft-capping);
    2) choose the next token from those logits (app/core/sampling.py, through `Sequence.choose`);
    3) turn it into text and check the stop rules (app/core/detokenize.py, app/core/stopping.py), and yield an event;
    4) decode: feed only the new token at its position, and go back to 2.

`generate()` is that loop for one request. Both feeding steps are the one forward pass every serving path runs
(app/core/runner/forward.py); the engine drives the same steps for many requests at once (app/core/engine/step.py).
`reference_generate` is the article's first, cache-free version, kept as a test oracle: it must produce exactly
the same greedy tokens.
"""

from __future__ import annotations

from typing import Iterator, Sequence as Seq

import torch

from app.core.runner.forward import forward
from app.core.sampling import SamplingParams
from app.core.sequence import Sequence, TokenEvent
from app.models.logits import logits_from_hidden


def prefill(model, seq: Sequence) -> torch.Tensor:
    """Run the whole prompt into the sequence's cache: float32 logits [1, vocab] for the next token only."""
    return forward(model, [(seq, seq.prompt_len)], engine_pass=False)  # the solo pass: model.generate()'s arithmetic


def decode_step(model, seq: Sequence) -> torch.Tensor:
    """Feed only the newest token at its position; the cache holds everything before it. -> [1, vocab]"""
    return forward(model, [(seq, 1)], engine_pass=False)


def generate(model, tokenizer, prompt_ids: Seq[int], params: SamplingParams, eos_ids: Seq[int],
             max_context: int) -> Iterator[TokenEvent]:
    """Stream one request's tokens. Stop iterating at any time to cancel; the cache goes with the Sequence."""
    seq = Sequence(model, tokenizer, prompt_ids, params, eos_ids, max_context)
    logits = prefill(model, seq)  # 1) prefill
    while True:
        event = seq.choose(logits)  # 2) choose + 3) detokenize and check stop rules
        yield event
        if event.finish_reason:
            return
        logits = decode_step(model, seq)  # 4) decode: feed only the new token


@torch.inference_mode()
def reference_generate(model, prompt_ids: Seq[int], max_new_tokens: int, eos_ids: Seq[int]) -> list[int]:
    """The article's first version: no cache, the whole sequence every step, greedy. A test oracle, not for serving."""
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    output: list[int] = []
    for _ in range(max_new_tokens):
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # [1, S, H]
        logits = logits_from_hidden(model, hidden[:, -1:, :])[:, -1]  # [1, vocab]: last position only
        next_id = logits.argmax(dim=-1)  # [1]
        output.append(int(next_id.item()))
        if output[-1] in eos_ids:
            break
        ids = torch.cat([ids, next_id[:, None]], dim=-1)
    return output
