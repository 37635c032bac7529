"""The one forward pass: every serving pass runs the model body here, whatever it feeds.

A pass feeds some rows, each a sequence (anything with `token_ids` [1, size] and its own `cache`) and how many of
its next tokens to feed: a prefill chunk, 1 to decode, or the newest token and k drafts to verify them
(app/core/speculative.py). `forward` runs them:
- one row, outside the case below: the solo pass, HF's own attention over the row's own cache, as the article's
  loop runs it (46.1 -> 42.3 ms a step for one int8 stream on 2 AVX2 cores against packing one row);
- otherwise: all rows packed into one row of tokens, each row's keys and values landing in its own cache
  (app/core/runner/packed.py). On a CPU in half precision one row packs too: the packed pass's fp32 decode
  matmuls beat SDPA there; and so does a row with an 8-bit cache, whose decode reads it without a dense copy.

`run_pass` is the one dispatcher: the compiled decode step where it takes the pass (app/core/runner/static_step.py,
decode-only passes, DECODE_STEP=compiled), else `forward`. The engine's StepRunner and every tensor-parallel
follower call it, so all ranks take the same path on the same inputs.

A row's sequence may carry a LoRA adapter (`seq.adapter`): the pass adds each row's own low-rank product to the
body's linears (app/models/lora_layers.py), so rows of different adapters and the base share one pass; under
`invariant`, each product in calls checked as the linears' are.

`invariant` (BATCH_INVARIANT, `LoadedModel.batch_invariant`): every row's numbers are fixed by its own request,
whatever shares the pass. One row packs too (the solo pass is another attention path than the packed one), and
attention runs in calls fixed by absolute positions (app/core/runner/pieces.py).

`engine_pass`: in fp32 on a CPU, the engine's passes take several rows of a linear on faster kernels
(app/models/batch_rows.py), which round differently, as any batching does. `generate()` passes False: its one row
is always the solo pass on `nn.Linear`'s own arithmetic, so it keeps `model.generate()`'s tokens bit for bit.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Sequence as Seq

import torch

from app.core.runner.image_groups import row_groups, solo_masks
from app.core.runner.kv_pool import POOLED
from app.core.runner.packed import (PACKED, PACKED_EAGER, PACKED_STEP, PackedCaches, attention_windows, decode_kernel,
                                    decode_matmuls, latent_kv, packed_inputs)
from app.models.batch_rows import batch_rows
from app.models.lora_layers import adapter_rows
from app.models.logits import logits_from_hidden


@torch.inference_mode()
def forward(model, work: Seq[tuple[object, int]], n_out: Seq[int] | None = None,
            engine_pass: bool = True, invariant: bool = False) -> torch.Tensor:
    """Feed each sequence its next `n` tokens; float32 logits at each one's last `n_out[i]` fed positions (default
    1), stacked in order: [sum(n_out), vocab]. Only those positions go through lm_head."""
    n_out = n_out or [1] * len(work)
    device = work[0][0].token_ids.device
    packed = model.config._attn_implementation in (PACKED, PACKED_EAGER, POOLED)  # POOLED: packed, save the pooled
    # step's calls
    items = []
    for seq, n in work:
        cached = seq.cache.get_seq_length()
        items.append((seq.token_ids[0, cached : cached + n], cached))  # ([n] token ids, first position)
    groups = [row_groups(seq, start, len(tokens)) for (seq, _), (tokens, start) in zip(work, items)]  # Gemma 3
    int8 = getattr(work[0][0].cache, "int8", False)  # an 8-bit cache: one row packs too, to read it where it lies
    kernel = decode_kernel(model)  # our decode attention (a CPU outside the fp32 oracle): one row packs too, to use it
    packs_alone = engine_pass and packed and (invariant or int8 or kernel or decode_matmuls(device, model.dtype))
    if len(work) == 1 and not packs_alone:
        (seq, _), ((tokens, start),) = work[0], items  # the solo pass: the row's own cache, no mask to build
        inputs = {"input_ids": tokens[None, :], "cache": seq.cache,  # [1, n]
                  "position_ids": torch.arange(start, start + len(tokens), device=device)[None, :]}
        spans = [(0, len(tokens))]
    else:
        if not packed:
            raise ValueError("several rows in one pass need packed attention (enable_packed_batching)")
        inputs = packed_inputs(items, device)  # [1, T_total], each row at its own positions
        spans = inputs.pop("spans")
        starts = [start for _, start in items] if invariant else None  # a row feeds its prompt below its length
        prefill = [start < seq.prompt_len for (seq, _), (_, start) in zip(work, items)]
        inputs["cache"] = PackedCaches([seq.cache for seq, _ in work], spans, device, attention_windows(model),
                                       latent=latent_kv(model.config) is not None, starts=starts, prefill=prefill,
                                       views=model.config._attn_implementation == PACKED, groups=groups,
                                       kernel=kernel)
        if inputs["cache"].latent:  # MLA: attention cuts the keys the model expanded (app/core/runner/packed.py)
            inputs[PACKED_STEP] = inputs["cache"]
    _write_images(model, inputs, work, items, spans)  # a prompt chunk with image placeholders: their embeddings
    _rope_positions(inputs, work, items, device)  # M-RoPE: each token's 3 rotary positions, where a row has them
    if groups[0] and not isinstance(inputs["cache"], PackedCaches):  # the solo pass over image tokens that see
        inputs["attention_mask"] = solo_masks(model, inputs, groups[0], items[0][1])  # each other both ways
    adapters = [getattr(seq, "adapter", None) for seq, _ in work]  # each row's LoRA adapter, None: the base's
    with batch_rows() if engine_pass else nullcontext(), adapter_rows(adapters, spans, device, invariant):
        hidden = model.model(**inputs, use_cache=True).last_hidden_state  # [1, T_total, hidden]
        last = torch.tensor([end - k for (_, end), m in zip(spans, n_out) for k in range(m, 0, -1)], device=device)
        return logits_from_hidden(model, hidden[:, last])[0].float()  # [sum(n_out), vocab]


def _write_images(model, inputs: dict, work, items, spans) -> None:
    """Where a row feeds image placeholders of its prompt, feed embeddings instead of ids: the tokens' own, with the
    image's features written over the placeholders, as the VLM's forward does (app/models/vision.py). Deepstack
    (Qwen3-VL): the placeholders' positions in the pass and, per layer, what each adds to that layer's output."""
    chunks = []
    for (seq, _), (tokens, start), (offset, _) in zip(work, items, spans):
        if getattr(seq, "images", None) is not None and start < seq.prompt_len:
            at, embeds, deep = seq.images.chunk(start, start + len(tokens))  # [k] offsets, [k, hidden], per layer
            if len(at):
                chunks.append((offset + at, embeds, deep))
    if not chunks:
        return
    embeds = model.get_input_embeddings()(inputs.pop("input_ids"))  # [1, T_total, hidden]
    for at, values, _ in chunks:
        embeds[0, at.to(embeds.device)] = values.to(embeds.device, embeds.dtype)
    inputs["inputs_embeds"] = embeds
    if chunks[0][2] is not None:  # the chunks in the pass's order, each ascending: as the mask indexes them
        mask = torch.zeros(embeds.shape[:2], dtype=torch.bool, device=embeds.device)  # [1, T_total]
        for at, _, _ in chunks:
            mask[0, at.to(embeds.device)] = True
        inputs["visual_pos_masks"] = mask
        inputs["deepstack_visual_embeds"] = [torch.cat([deep[i] for _, _, deep in chunks]).to(embeds.device)
                                             for i in range(len(chunks[0][2]))]


def _rope_positions(inputs: dict, work, items, device: torch.device) -> None:
    """Qwen2-VL's family places a prompt's image tokens on a grid (3 rotary positions a token) and every later token
    at its index + a delta (app/models/vision.py's ImagePrompt): where any row has such positions, every row's go
    in as [3, 1, T]; a text row's 3 are its index, as the model itself expands a 2-D position_ids."""
    if not any(getattr(getattr(seq, "images", None), "rope", None) is not None for seq, _ in work):
        return
    rows = []
    for (seq, _), (tokens, start) in zip(work, items):
        images = getattr(seq, "images", None)
        if images is not None and images.rope is not None:
            rows.append(images.rope_positions(start, start + len(tokens)))
        else:
            rows.append(torch.arange(start, start + len(tokens)).expand(3, -1))
    inputs["position_ids"] = torch.cat(rows, dim=1)[:, None, :].to(device)  # [3, 1, T_total]


def run_pass(model, work: Seq[tuple[object, int]], n_out: Seq[int] | None = None,
             compiled=None, invariant: bool = False) -> tuple[torch.Tensor, str]:
    """The dispatcher for every serving pass: (logits as `forward` returns them, the path that ran them).

    `compiled`: a StaticDecodeStep, or None. It takes a pass where every row decodes one token and the pool
    holds them; otherwise its pooled rows first make room for what they feed (a full pool moves a row to a cache
    of its own rather than failing the pass) and the pass runs eagerly."""
    if compiled is not None:
        # the compiled step is traced without adapters: a pass with an adapter row runs eagerly
        # ... and without M-RoPE rows, whose positions are not their indices (app/models/vision.py)
        if all(n == 1 and not seq.prefilling and getattr(seq, "adapter", None) is None
               and getattr(getattr(seq, "images", None), "rope", None) is None for seq, n in work):
            logits = compiled.run([seq for seq, _ in work])  # None: it cannot take this pass
            if logits is not None:
                return logits, compiled.path
        compiled.make_room(work)
    return forward(model, work, n_out, invariant=invariant), "eager"
