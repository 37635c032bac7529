"""Image tokens that attend to each other both ways during prefill (Gemma 3), in passes that are otherwise causal.

Gemma 3's forward groups a prompt's image tokens into runs of consecutive placeholders (one image, or one
pan-and-scan crop: the runs of its `token_type_ids`) and lets every token of a run see every other token of it,
later ones too, on every layer: full-attention layers take causal OR same-run, sliding layers the window AND
(causal OR same-run), so the window still cuts a long run's far past (`create_masks_for_vision_model`). Decode
steps are causal. The runs ride with the request (`ImagePrompt.groups`, app/models/vision.py), and:
- a prefill chunk never cuts a run (app/core/engine/step.py, `keep_groups_whole`): a query could not see the keys
  of the run's tokens not fed yet;
- the packed pass ORs a chunk's runs into its mask before the window cuts (app/core/runner/packed.py, `chunk_mask`),
  and under BATCH_INVARIANT a piece's keys run on to the end of the runs its queries are in
  (app/core/runner/pieces.py);
- the solo pass gives the model the masks its own forward builds from the runs (`solo_masks`).
The prefix cache is off for Gemma 3 as for every model with sliding-window layers (app/core/engine/prefix_cache.py).
"""

from __future__ import annotations

import sys

import torch

Groups = tuple[tuple[int, int], ...]  # runs as (first, end) offsets from a row's first fed position


def row_groups(seq, start: int, n: int) -> Groups:
    """The runs that a row's next `n` tokens from position `start` feed (or reach into); () for most rows."""
    images = getattr(seq, "images", None)
    return images.groups_in(start, start + n) if images is not None else ()


def solo_masks(model, inputs: dict, groups: Groups, start: int) -> dict:
    """The masks per layer type that the model's own family builds for this chunk from its image runs (Gemma 3's
    `create_masks_for_vision_model`), for the solo pass: `inputs` as the pass feeds it (embeddings, the row's own
    cache, position ids). The runs are numbered per position from the sequence's start, as HF reads them."""
    n = inputs["inputs_embeds"].shape[1]
    runs = torch.full((1, start + n), -1, dtype=torch.long, device=inputs["inputs_embeds"].device)
    for i, (first, end) in enumerate(groups):
        runs[0, max(start + first, 0) : start + end] = i
    build = sys.modules[type(model).__module__].create_masks_for_vision_model
    return build(config=model.config, inputs_embeds=inputs["inputs_embeds"], attention_mask=None,
                 cache=inputs["cache"], position_ids=inputs["position_ids"], block_sequence_ids=runs)
