"""How many bytes of KV cache the engine may hold, and who holds them.

A request's KV cache grows by a fixed number of bytes per token: per layer, keys and values for each KV head,
`2 x kv_heads x head_dim x dtype size` (a sliding-window layer stops growing at its window). The engine admits a
request only when its worst case, prompt + max_tokens, fits what is left of the budget, and reserves that much
until the request ends. So memory use is bounded by the budget however the load arrives, and nothing has to be
evicted mid-generation. Requests that do not fit yet wait in the queue; one that could never fit is refused.

Anything else that keeps KV (a prefix cache) takes its bytes from the same budget with the same calls:
`reserve(owner, nbytes)` and `release(owner)`. It can also register a reclaimer, which `reserve` calls to make
room (evict) before it answers that a request must wait, but only when evicting would let the request in now.
What holds KV for the server's whole life (the compiled step's pool, DECODE_STEP=compiled) is `set_aside` once:
held like a reservation, and no request may count on it (`room`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Hashable

import psutil
import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from app.core.runner.kv_store import KEY_GROUP, VALUE_GROUP, scales_per_token
from app.core.runner.packed import latent_kv
from app.errors import InvalidRequest

log = logging.getLogger("app.core.engine.kv_budget")

CPU_RAM_FRACTION = 0.5  # of the RAM available after loading; the rest is for activations, the OS and neighbours
GPU_MARGIN_FRACTION = 0.1  # of the GPU's memory kept free for activations (as vLLM's gpu_memory_utilization=0.9)


@dataclass(frozen=True)
class KVLayout:
    """Per layer: KV bytes per cached token, and the most tokens the layer keeps (None: all of them)."""

    layers: tuple[tuple[int, int | None], ...]

    @classmethod
    def from_config(cls, config, dtype: torch.dtype, int8: bool = False) -> KVLayout:
        """Read from the model config the way transformers builds a DynamicCache from it: head_dim when the config
        gives one (it need not be hidden_size / heads), KV heads for grouped-query attention, and each layer's kind
        (sliding windows and chunked attention keep at most their window; layers that reuse another's KV keep none).
        `int8` (KV_CACHE_DTYPE=int8): a full-attention layer keeps a byte per value and an fp16 scale per group
        (app/core/runner/kv_store.py); a sliding one stays in `dtype`."""
        text = config.get_text_config(decoder=True)
        latent = latent_kv(text)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        per_layer = getattr(text, "per_layer_config", None) or [text] * len(layer_types)
        layers = []
        for layer_type, kwargs, layer_config in zip(layer_types, layer_kwargs, per_layer):
            heads = layer_config.num_attention_heads
            kv_heads = getattr(layer_config, "num_key_value_heads", None) or heads
            head_dim = getattr(layer_config, "head_dim", None) or layer_config.hidden_size // heads
            per_token = 0 if layer_type == "dummy" else 2 * kv_heads * head_dim * dtype.itemsize
            if int8 and layer_type == "full_attention":
                scales = scales_per_token(head_dim, KEY_GROUP) + scales_per_token(head_dim, VALUE_GROUP)
                per_token = kv_heads * (2 * head_dim + 2 * scales)  # a byte a value, 2 bytes a scale
            if latent is not None:  # MLA caches one latent and one rotary key (app/core/runner/packed.py)
                per_token = sum(latent) * dtype.itemsize
            layers.append((per_token, kwargs.get("sliding_window")))
        return cls(tuple(layers))

    @property
    def bytes_per_token(self) -> int:
        """While no window is full: what one more token costs."""
        return sum(per_token for per_token, _ in self.layers)

    def bytes_for(self, tokens: int) -> int:
        """KV bytes of one sequence of `tokens` tokens."""
        return sum(per_token * (tokens if window is None else min(tokens, window)) for per_token, window in self.layers)


class KVBudget:
    """Bytes reserved against a fixed capacity, by owner. Thread-safe; `reserve` never blocks."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._held: dict[Hashable, int] = {}
        self._lock = threading.Lock()
        self._reclaimers: list[tuple[Callable[[int], object], Callable[[], int]]] = []
        self.set_aside_bytes = 0

    @property
    def room(self) -> int:
        """What requests may reserve at most: the capacity less what is set aside for good."""
        return self.capacity - self.set_aside_bytes

    def set_aside(self, owner: Hashable, nbytes: int) -> None:
        """Hold `nbytes` for the server's whole life (before any request is admitted)."""
        if not self.reserve(owner, nbytes):
            raise ValueError(f"cannot set aside {nbytes:,} bytes of a {self.capacity:,}-byte KV budget")
        self.set_aside_bytes += nbytes

    @property
    def in_use(self) -> int:
        with self._lock:
            return sum(self._held.values())

    def add_reclaimer(self, reclaim: Callable[[int], object], reclaimable: Callable[[], int]) -> None:
        """`reclaim(nbytes)` is asked to release about that many bytes (through `release`) when a reservation
        does not fit; it must not call `reserve`. `reclaimable()` says how many it could release now."""
        self._reclaimers.append((reclaim, reclaimable))

    def reserve(self, owner: Hashable, nbytes: int) -> bool:
        """Add `nbytes` to what `owner` holds if it fits, asking the reclaimers to make room only when what they
        could free would let it fit now; False: nothing changed (and nothing was evicted)."""
        with self._lock:
            if sum(self._held.values()) + nbytes <= self.capacity:
                self._held[owner] = self._held.get(owner, 0) + nbytes
                return True
        # A request that cannot fit even after every eviction waits with the cache intact: admission asks again
        # each step, and evicting on every ask would empty the cache for nothing, again and again.
        if self.in_use - sum(reclaimable() for _, reclaimable in self._reclaimers) + nbytes > self.capacity:
            return False
        for reclaim, _ in self._reclaimers:
            reclaim(nbytes - (self.capacity - self.in_use))
            with self._lock:
                if sum(self._held.values()) + nbytes <= self.capacity:
                    self._held[owner] = self._held.get(owner, 0) + nbytes
                    return True
        return False

    def request_bytes(self, layout: KVLayout, prompt_len: int, max_new: int) -> int:
        """A request's worst case (prompt + max_tokens); InvalidRequest if even an empty budget could not hold it."""
        need = layout.bytes_for(prompt_len + max_new)
        if need > self.room:
            raise InvalidRequest(
                f"this request could need {need:,} bytes of KV cache ({prompt_len} prompt + {max_new} max_tokens "
                f"tokens x {layout.bytes_per_token:,} bytes per token), more than the server's whole KV cache "
                f"budget for requests of {self.room:,} bytes (KV_CACHE_BYTES); lower max_tokens or shorten the "
                "prompt",
                param="max_tokens", code="kv_cache_exceeded")
        return need

    def release(self, owner: Hashable) -> int:
        """Free everything `owner` holds; returns how much that was (0 if nothing: releasing twice is harmless)."""
        with self._lock:
            return self._held.pop(owner, 0)


def available_ram() -> int:
    """RAM this process can still get: the machine's available memory, or what its cgroup (a container's memory
    limit) leaves, whichever is smaller. /proc/meminfo alone shows the host's memory inside a container."""
    available = psutil.virtual_memory().available
    limit_file, usage_file = Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")
    try:
        limit = limit_file.read_text().strip()
        if limit != "max":
            available = min(available, int(limit) - int(usage_file.read_text()))
    except (OSError, ValueError):
        pass  # no cgroup v2 memory controller here
    return max(0, available)


def default_kv_cache_bytes(device: torch.device) -> int:
    """With the model loaded: on a GPU, its free memory less a margin for activations; on a CPU, a fraction of the
    RAM still available."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, free - int(GPU_MARGIN_FRACTION * total))
    return int(CPU_RAM_FRACTION * available_ram())


def export_kv_cache_gauges(metrics, budget: KVBudget, layout: KVLayout, prefix_cache: Callable[[], object],
                           block_size: int) -> None:
    """What an endpoint picker reads (app/gateway_metrics.py): KV usage 0..1 at each scrape, and the cache's
    shape in prefix-cache blocks (`block_size` without a prefix cache), the unit a prefix hit is counted in."""
    metrics.kv_cache_usage.set_function(lambda: kv_cache_usage(budget, prefix_cache()))
    cache = prefix_cache()
    block = cache.block_size if cache is not None else block_size
    blocks = budget.capacity // max(1, layout.bytes_for(block))
    metrics.kv_cache_info.labels(block_size=str(block), num_gpu_blocks=str(blocks)).set(1)


def kv_cache_usage(budget: KVBudget, prefix_cache) -> float:
    """The share of the KV budget that admitted requests reserve (each its prompt + max_tokens worst case), 0 to 1.
    Reserved, not used: admission compares the reservation with the budget, so this is what says whether the next
    request would queue here. The prefix cache's bytes count as free, since a reservation evicts them on demand
    (as vLLM counts cached but unreferenced blocks as free)."""
    if budget.room <= 0:
        return 1.0
    held = budget.in_use - budget.set_aside_bytes - (prefix_cache.bytes if prefix_cache is not None else 0)
    return min(1.0, max(0.0, held / budget.room))
