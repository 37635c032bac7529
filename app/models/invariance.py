"""BATCH_INVARIANT: a request's numbers do not depend on what else shares its forward pass.

Batching changes floating-point results because a kernel may sum a row's products in another order when the call
has more rows (docs/walkthrough.md shows it on one dot product). With BATCH_INVARIANT on, every op that could see
the batch computes each row the same way at any batch: the answer alone and under load is the same, token for
token and logprob for logprob, and a seeded sample repeats. `resolve_batch_invariant` decides what `auto` means.
"""

from __future__ import annotations

import torch

INVARIANT_MODES = ("auto", "on", "off")


def resolve_batch_invariant(mode: str, device: torch.device) -> tuple[bool, str]:
    """(on?, why) for BATCH_INVARIANT=`mode` on `device`."""
    if mode not in INVARIANT_MODES:
        raise ValueError(f"batch_invariant must be one of {', '.join(INVARIANT_MODES)}, not {mode!r}")
    if mode != "auto":
        return mode == "on", f"BATCH_INVARIANT={mode}"
    if device.type != "cpu":
        return False, f"auto: off on {device.type} (its cost there is not measured yet)"
    return False, "auto: off (provisional)"
