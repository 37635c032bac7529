"""A request's own KV cache whose storage grows by doubling, so a decode step appends in place; in the model's dtype
or, with KV_CACHE_DTYPE=int8, in 8 bits.

transformers' DynamicLayer grows by `torch.cat`: every token, every layer, a new tensor and a copy of all its keys
and values. `GrowingLayer` keeps them in storage `[1, kv_heads, capacity, d]`, writes new tokens after the filled
part and hands out views of it, `[1, kv_heads, length, d]`: every reader of `layer.keys` (attention, the prefix
cache, the KV pool's `adopt`) sees the usual shape. Full storage doubles, never past `limit` (prompt + max_tokens,
what the KV budget reserved): O(log n) copies for n tokens. `crop` (rejected drafts, a rolled-back pass) moves the
length back and the next tokens overwrite the dropped ones; no view outlives its pass. `KVStore` is a DynamicCache
with these for its full-attention layers (a sliding layer never outgrows its window).

`Int8Layer` is the same store in 8 bits (one store, not a second one: only what a slot holds differs). Each token's
keys and values are kept as int8 codes and an fp16 scale per token, head and group of channels (laid out as
`Int8Layer` says): absmax / 127, as llama.cpp's q8_0 blocks are. Values take groups of 32 (q8_0's:
34 bytes per 32), keys groups of 4 (6 bytes per 4); together 0.64x bf16's bytes. The keys decide it: Qwen2's k_proj
bias reaches 145 in its first layers, so a group holding such a channel rounds its small neighbours to nothing. In
the embedded Qwen2.5-0.5B over 8,192 tokens of Python, served in bf16, keys in groups of 32 cost +1.42% perplexity
against the bf16 cache (values in groups of 32 with exact keys: -0.02%), of 16 +0.70%, of 8 +0.31%, of 4 +0.01%;
over the GPL's English (`bench perplexity`, from the GGUF as served) groups of 8 cost +2.81% where llama.cpp's q8_0
cache costs +3.76% on the same file, and groups of 4 -0.27%. A Hadamard rotation of the keys bought nothing at 8
or 16; quantizing them before RoPE with the bias taken out would keep groups of 8 (+0.14% in an fp32 trial) at the
price of adding each position's rotated bias back on every read. Nor do groups of 32 (q8_0's 0.53x bf16's bytes)
come back by taking the outliers out exactly, the keys divided by a power of two per block of channels that RoPE
rotates together and the queries multiplied by it (the scores unchanged, bit for bit): in an fp32 trial over 3,570
tokens of the GPL, the mean KL divergence per token from the full-width cache's next-token distribution fell from
0.0248 to 0.0027 (factors from the bias's size) or 0.0026 (from one calibration pass), still about twice groups of
4's 0.0015 (perplexity +1.1% against +0.1%); groups of 16 so: 0.0024. Only the new tokens are quantized, as they are
written. Its `keys` / `values` are `QuantizedKV` views:
decode attention's kernel (app/models/decode_attention.py) reads the codes and scales where they lie, as it reads a
bf16 cache (without it, packed.py dequantizes each row's keys into its fp32 scratch); calls that need dense tensors
(a prefill chunk, HF's own attention, BATCH_INVARIANT's calls) get `update`'s dequantized copy. The prefix cache
keeps codes and scales as they lie, so a hit restores the very values a cold run attends to. Every reader therefore
sees the rounded values, prefill included: a request's answer does not depend on whether its prefix came from the
cache or from a chunked prefill.

Where a decode step's time goes (Qwen2.5-0.5B in bf16, one stream, a 2-core Zen 4; per layer, each step runs 24):
- Quantizing one token is a chain of small ops, each a few µs whatever its size: keys and values apart took ~80 µs
  a layer with the writes. `Int8Layer` quantizes both in one chain (a value group's absmax is the largest of its
  four key groups') written straight into the storage: ~50 µs, against ~4 µs for a bf16 layer's two writes.
- Dequantizing keys in groups of 8 with the channels innermost broadcasts each scale over 8 values, a slow loop: at
  4,096 tokens ~225 µs for a layer's keys and values, against ~50 µs to cast bf16 ones. The keys' storage therefore
  keeps the tokens innermost ([.., d, capacity]: each scale runs along a row of tokens), and keys and values take a
  copy of the codes and a multiply each, ~110 µs (one multiply of int8 by fp32 was slower than the two). The values
  keep the channels innermost (groups of 32 broadcast well, and attention's product with [.., d, n] values was
  slower than with [.., n, d]).
- Not taken: a bf16 tail of the newest tokens, quantized a block at a time, would leave the newest tokens unrounded
  for a decode row but rounded for a prefill chunk or a speculative verify pass over the same positions (one dense
  key tensor serves all of a chunk's queries), so speculation and chunking would change a request's tokens;
  torch.compile of the dequantize, timed: ~35 µs a call at 128 tokens and ~170 at 4,096, above eager's ~9 and ~48.
Where decode attention's kernel is built, it also replaces that chain (`quantize_into`: the same bits in one call)
and reads the codes with no multiply over a copy; without it, the chain and the multiply remain.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from app.models.decode_attention import loaded_kernel

MIN_CAPACITY = 256  # tokens of storage a layer starts with (or its first pass, if longer)
KEY_GROUP, VALUE_GROUP = 4, 32  # channels per fp16 scale (module docstring); a head not a multiple of it: one scale


def scales_per_token(dim: int, group: int) -> int:
    """Scales one head of `dim` channels keeps per token in groups of `group` (one where `dim` is no multiple)."""
    return dim // group if dim % group == 0 else 1


@dataclass
class QuantizedKV:
    """Keys or values in 8 bits: `codes` int8 [..., n, d] and `scales` fp16 [..., n, d // group]; value = code *
    scale. Indexing and `shape` act on the leading dims as a tensor's would (never slice the last one)."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def __getitem__(self, index) -> QuantizedKV:
        return QuantizedKV(self.codes[index], self.scales[index])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales))

    def dequantize(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """The values, in `out` (fp32, this shape, any strides) if given, else in a new tensor laid out as the
        codes are: the product is taken in fp32, where it is exact."""
        if out is None:
            out = fp32_like(self.codes, torch.empty(self.codes.numel(), device=self.codes.device))
        # Two passes over [.., d, n] (n, the tokens, innermost in an Int8Layer's storage and in `fp32_like`): the
        # codes converted, then each group's rows times its scales. Channels innermost, a broadcast over groups of
        # 8 ran ~10x slower than a copy; one mixed-dtype multiply is slower than the two passes.
        flipped = out.transpose(-1, -2).copy_(self.codes.transpose(-1, -2))
        flipped.unflatten(-2, (self.scales.shape[-1], -1)).mul_(self.scales.transpose(-1, -2).unsqueeze(-2))
        return out if dtype == torch.float32 else out.to(dtype)


def fp32_like(codes: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """A view [.., n, d] of the flat fp32 `buffer` laid out as `codes` lie: tokens innermost where they are."""
    *lead, n, d = codes.shape
    if codes.stride(-1) == 1 and n > 1:  # channels innermost (values, a prefix cache block)
        return buffer[: codes.numel()].view(codes.shape)
    return buffer[: codes.numel()].view(*lead, d, n).transpose(-1, -2)


def quantize_kv(x: torch.Tensor, group: int = VALUE_GROUP) -> QuantizedKV:
    """[..., d] floats -> int8 codes and an fp16 absmax scale per group of `group` channels."""
    group = x.shape[-1] // scales_per_token(x.shape[-1], group)
    grouped = x.float().unflatten(-1, (-1, group))  # [..., d // group, group]
    scales = (grouped.abs().amax(-1) / 127).clamp_(max=torch.finfo(torch.float16).max).to(torch.float16)
    divisor = scales.float().clamp_(min=torch.finfo(torch.float32).tiny)[..., None]  # an all-zero group: codes 0
    codes = (grouped / divisor).round_().clamp_(-127, 127).to(torch.int8)  # not in place: x.float() may be x
    return QuantizedKV(codes.flatten(-2), scales)


def kv_cat(parts: list, dim: int):
    """torch.cat for tensors or QuantizedKVs (along a dim before the last)."""
    if isinstance(parts[0], QuantizedKV):
        return QuantizedKV(torch.cat([p.codes for p in parts], dim), torch.cat([p.scales for p in parts], dim))
    return torch.cat(parts, dim)


def kv_stack(parts: list):
    """torch.stack for tensors or QuantizedKVs."""
    if isinstance(parts[0], QuantizedKV):
        return QuantizedKV(torch.stack([p.codes for p in parts]), torch.stack([p.scales for p in parts]))
    return torch.stack(parts)


def kv_nbytes(t) -> int:
    return t.nbytes() if isinstance(t, QuantizedKV) else t.numel() * t.element_size()


class GrowingLayer(DynamicLayer):
    """One full-attention layer: `keys` / `values` are views [1, kv_heads, length, d] of storage that grows by
    doubling. `grows` counts the reallocations (a test bounds it)."""

    TOKEN_DIMS = (-2, -2)  # each storage tensor's token dim

    def __init__(self, limit: int | None = None):
        super().__init__()
        self.limit = limit  # most tokens this layer will ever hold (None: unbounded)
        self.length = 0
        self.grows = 0
        self.capacity = 0  # tokens the storage has room for
        self._storage: list[torch.Tensor] = []

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = (key_states.codes if isinstance(key_states, QuantizedKV) else key_states).device
        self.is_initialized = True

    def _allocate(self, key_states, value_states, capacity: int) -> list[torch.Tensor]:
        """Storage for `capacity` tokens, each [1, kv_heads, capacity, d]."""
        return [t.new_empty(*t.shape[:2], capacity, t.shape[-1]) for t in (key_states, value_states)]

    def _write(self, key_states, value_states, start: int, end: int) -> None:
        self._storage[0][..., start:end, :] = key_states
        self._storage[1][..., start:end, :] = value_states

    def _views(self, length: int) -> tuple:
        return self._storage[0][..., :length, :], self._storage[1][..., :length, :]

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple:
        """key_states, value_states: [1, kv_heads, n, d] new tokens, written in place -> views of every token so
        far, as the layer keeps them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(key_states, value_states, end)
        self._write(key_states, value_states, start, end)
        self._set_length(end)
        return self.keys, self.values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """As DynamicLayer's: the keys and values of every token so far, as tensors."""
        return self.append(key_states, value_states)

    def _grow(self, key_states, value_states, needed: int) -> None:
        """New storage of at least `needed` tokens (twice the old, at least MIN_CAPACITY, at most `limit`), holding a
        copy of the filled part."""
        capacity = max(needed, MIN_CAPACITY, 2 * self.capacity)
        if self.limit is not None:
            capacity = max(needed, min(capacity, self.limit))
        with torch.inference_mode(False):  # plain tensors: a write outside inference mode must not fail later
            grown = self._allocate(key_states, value_states, capacity)
        for new, old, dim in zip(grown, self._storage, self.TOKEN_DIMS):
            new.narrow(dim, 0, self.length).copy_(old.narrow(dim, 0, self.length))
        self._storage, self.capacity = grown, capacity
        self.grows += 1

    def _set_length(self, length: int) -> None:
        self.length = length
        if self._storage:
            self.keys, self.values = self._views(length)

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """As DynamicLayer's: drop the last `-tokens_to_remove` tokens (a length change; the storage stays)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        self._set_length(max(0, self.length + tokens_to_remove))

    def reset(self) -> None:
        self._storage, self.length, self.capacity = [], 0, 0
        self.keys, self.values, self.is_initialized = None, None, False


class Int8Layer(GrowingLayer):
    """A GrowingLayer in 8 bits (module docstring): `keys` / `values` are QuantizedKV views; `update` hands HF's
    attention dense copies in the model's dtype.

    Storage: the keys' codes [1, kv_heads, d, capacity] int8 and scales [1, kv_heads, d // 8, capacity] fp16,
    tokens innermost, so that dequantizing broadcasts each scale along the tokens; the values' as a GrowingLayer's,
    [1, kv_heads, capacity, d] and [.., capacity, d // 32], channels innermost, where the product with the
    attention weights runs fastest (module docstring)."""

    TOKEN_DIMS = (-1, -1, -2, -2)

    def _allocate(self, key_states, value_states, capacity: int) -> list[torch.Tensor]:
        (_, heads, _, dim), value_dim, device = key_states.shape, value_states.shape[-1], self.device
        self.groups = scales_per_token(dim, KEY_GROUP), scales_per_token(value_dim, VALUE_GROUP)
        if value_dim != dim:  # one chain quantizes both (`_write`): only MLA differs, and it is refused at start
            raise ValueError("KV_CACHE_DTYPE=int8 needs keys and values of one head size")
        return [torch.empty(1, heads, dim, capacity, dtype=torch.int8, device=device),
                torch.empty(1, heads, self.groups[0], capacity, dtype=torch.float16, device=device),
                torch.empty(1, heads, capacity, dim, dtype=torch.int8, device=device),
                torch.empty(1, heads, capacity, self.groups[1], dtype=torch.float16, device=device)]

    def _write(self, key_states, value_states, start: int, end: int) -> None:
        key_codes, key_scales, value_codes, value_scales = self._views_of(start, end)  # [1, kv_heads, n, ..] each
        if isinstance(key_states, QuantizedKV):  # a prefix cache hit: the codes as they were kept
            key_codes.copy_(key_states.codes), key_scales.copy_(key_states.scales)
            value_codes.copy_(value_states.codes), value_scales.copy_(value_states.scales)
            return
        if (kernel := loaded_kernel()) is not None and key_codes.device.type == "cpu":  # the same bits in one call
            kernel.quantize_into(key_states[0], key_codes[0], key_scales[0])
            kernel.quantize_into(value_states[0], value_codes[0], value_scales[0])
            return
        # without the kernel: `quantize_kv` for keys and values in one chain (a new token's are a few hundred bytes:
        # the ops' count is the cost): a value group's absmax is the largest of its key groups' (value groups are whole
        # multiples of key groups: 32 = 4 x 8, or the whole head)
        keys, values = self.groups
        x = torch.stack((key_states[0], value_states[0])).float()  # [2, kv_heads, n, d]
        grouped = x.unflatten(-1, (keys, -1))
        absmax = grouped.abs().amax(-1)  # [2, kv_heads, n, key groups]
        scales = torch.cat((absmax[0], absmax[1].unflatten(-1, (values, -1)).amax(-1)), -1)
        scales = scales.div_(127).clamp_(max=torch.finfo(torch.float16).max).half()  # as stored
        key_scales.copy_(scales[..., :keys]), value_scales.copy_(scales[..., keys:])
        divisor = scales.float().clamp_(min=torch.finfo(torch.float32).tiny)  # an all-zero group: codes 0
        grouped[0].div_(divisor[..., :keys, None])
        x[1].unflatten(-1, (values, -1)).div_(divisor[..., keys:, None])
        x.round_().clamp_(-127, 127)  # integers already: the int8 casts below are exact
        key_codes.copy_(x[0]), value_codes.copy_(x[1])

    def _views_of(self, start: int, end: int) -> tuple:
        """Tokens start..end of each part, [1, kv_heads, n, d or groups]."""
        key_codes, key_scales, value_codes, value_scales = self._storage
        return (key_codes[..., start:end].transpose(-1, -2), key_scales[..., start:end].transpose(-1, -2),
                value_codes[:, :, start:end], value_scales[:, :, start:end])

    def _views(self, length: int) -> tuple:
        key_codes, key_scales, value_codes, value_scales = self._views_of(0, length)
        return QuantizedKV(key_codes, key_scales), QuantizedKV(value_codes, value_scales)

    def update(self, key_states, value_states, *args, **kwargs):
        self.dtype = key_states.dtype
        keys, values = self.append(key_states, value_states)
        return keys.dequantize(self.dtype), values.dequantize(self.dtype)


class KVStore(DynamicCache):
    """A request's DynamicCache with `GrowingLayer`s (`int8`: `Int8Layer`s) for its full-attention layers.
    `limit`: the most tokens it will hold (prompt + max_tokens), so that doubling never reserves past what the KV
    budget counted."""

    def __init__(self, config, limit: int | None = None, int8: bool = False):
        super().__init__(config=config)
        layer = partial(Int8Layer if int8 else GrowingLayer, limit)
        self.int8 = int8
        self.layers = [layer() if type(old) is DynamicLayer else old for old in self.layers]
        if self.layer_class_to_replicate is not None:  # no config: layers made as `update` first meets them
            self.layer_class_to_replicate = layer

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> tuple:
        """As `update`, but an int8 layer hands back its QuantizedKV views, not dense copies (packed decode rows
        read them where they lie)."""
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if isinstance(layer, GrowingLayer):
            return layer.append(key_states, value_states)
        return self.update(key_states, value_states, layer_idx)

    @classmethod
    def holding(cls, keys: list, values: list, config, limit: int | None = None) -> KVStore:
        """A store holding a copy of each layer's keys and values, [1, kv_heads, n, d] each (a prefix cache hit):
        int8 where they are QuantizedKVs, kept as they are."""
        store = cls(config, limit, int8=isinstance(keys[0], QuantizedKV))
        for layer_idx, (k, v) in enumerate(zip(keys, values)):
            store.append(k, v, layer_idx)
        return store
