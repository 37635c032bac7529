"""What a failed forward pass leaves behind, and how to undo it so its rows can run again.

A pass that raises part way has already appended this step's keys and values to some layers of some requests'
caches. Before those rows are retried (after an out-of-memory error, in smaller groups), each cache is cut back to
the length it had before the pass. A sliding-window layer that has already dropped its oldest keys cannot be cut
back; its request fails instead of being retried with a corrupt cache.
"""

from __future__ import annotations

import torch


def is_out_of_memory(err: BaseException) -> bool:
    """CUDA's OutOfMemoryError, and the RuntimeErrors other allocators raise when they run out."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def release_cached_memory(device: torch.device) -> None:
    """Hand the allocator's cached blocks back, so a smaller retry can get contiguous memory."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cache_lengths(cache) -> list[int]:
    """Tokens each layer of a DynamicCache has seen so far."""
    return [layer.get_seq_length() for layer in cache.layers]


def roll_back(cache, lengths: list[int]) -> bool:
    """Cut each layer back to `lengths` (from `cache_lengths` before the pass). False: some layer cannot be."""
    for layer, before in zip(cache.layers, lengths):
        extra = layer.get_seq_length() - before
        if extra <= 0:
            continue
        if getattr(layer, "is_sliding", False) and layer.get_seq_length() >= layer.sliding_window:
            return False  # its oldest keys are gone already
        layer.crop(-extra)
    return True
