"""Many requests in one forward pass, while each request keeps owning its own DynamicCache.

The engine packs every active request's next tokens into one row: a decode token for each running request and a
prefill chunk for each new one, `[1, T_total]`, each with its own absolute position ids. The weights are read once
for all of them, which is the whole point at small batch sizes, where decoding is bound by memory bandwidth.

Two pieces make the HF model accept such a row without touching its code:
- `PackedCaches` stands in for the cache. When a layer stores the new keys and values, it splits them by request,
  appends each slice to that request's own DynamicCache, and hands back the per-request keys and values.
- `packed_attention` is registered as an attention implementation. For a packed call it attends each request's
  queries to that request's keys only, with HF's own SDPA function and the same causal rule as a solo run (which
  is why batched greedy output equals solo output), sliding windows included (each layer's window is read from
  the config as transformers reads it). For any other call it simply is HF's SDPA. A model whose attention
  transformers runs only on its eager kernel (Gemma 2's soft-capping, gpt-oss's sinks) is packed under
  `PACKED_EAGER` instead: each request's rows go through that model's own eager function with the mask its solo
  run would get, so only attention is per request, and the projections and MLPs still see all rows at once.
  Chunked attention and recurrent layers are refused at start (app/models/architectures.py).

The projections and MLPs see no padding at all. Each cache is a `KVStore` that grows in place
(app/core/runner/kv_store.py). On a CPU in bf16/fp16 (or over an 8-bit cache) the decode rows take our C++ kernel
where it is built (app/models/decode_attention.py: every row in one call, over its cache where it lies); without it,
two fp32 matmuls each (`grouped_decode_attention`: far faster there than SDPA) over one fp32 scratch that every
layer reuses, its keys and values cast (or dequantized) into it. Short rows (`PAD_UP_TO`), and every row in
fp32 or on a GPU, share one call over their keys left-padded to one width, the padding masked out (SDPA: measured
57-62 ms per batch-8 step, against 77 ms with one call per request). Each prefill chunk gets its own call, unpadded.
A step with one request (outside that case) is not packed at all: `forward` (app/core/runner/forward.py) runs it
as the solo pass.

With BATCH_INVARIANT on (`PackedCaches` given the rows' positions), none of that padding or chunk-sized calls:
each request's rows attend in calls fixed by its own positions (app/core/runner/pieces.py), on either function.

Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2) caches a compressed latent and one shared rotary key per
token, and the model expands them into keys and values of different sizes after the cache returns them; it cannot
expand a `PerRequest`. For such a model `PackedCaches.update` returns every request's latents joined into one row
instead, and the pass hands attention the step under `PACKED_STEP`, so that `packed_attention` cuts the expanded keys
and values back into requests at the lengths the update recorded.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Sequence
from weakref import WeakKeyDictionary

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from app.core.runner.kv_store import QuantizedKV, fp32_like
from app.core.runner.torch_decode import decode_matmuls, grouped_decode_attention
from app.core.runner.pieces import Call, attend_in_calls, invariant_calls

PACKED = "simple_serve_packed"
PACKED_EAGER = "simple_serve_packed_eager"  # packed, each request's attention on the model's own eager function
PACKED_STEP = "simple_serve_step"  # the keyword under which a latent-KV model's attention gets the PackedCaches
# Decode rows of at most this many keys share one padded call (fp32 matmuls on a CPU in half precision): at 8 rows of
# ~100 keys, 28 ms a step against 36 for a call per row; past it a call per row wins (8 rows of 250-509 keys: 37 ms
# against 132, the padded copies' fresh pages), and copies no cache.
PAD_UP_TO = 256
KERNEL_CHUNK = 16  # chunks of at most this many tokens (speculative verify passes) take the decode kernel too
_DECODE_KERNELS: WeakKeyDictionary = WeakKeyDictionary()  # model -> its decode rows' kernel (`enable_packed_batching`)


def latent_kv(config) -> tuple[int, int] | None:
    """MLA's cached sizes per token and layer, (latent, rotary key), as one 'key head' and one 'value head' of those
    sizes; None for a model that caches keys and values per KV head."""
    text = config.get_text_config(decoder=True)
    rank = getattr(text, "kv_lora_rank", None)
    return (rank, text.qk_rope_head_dim) if rank else None


@dataclass
class PerRequest:
    """One layer's keys (or values) for each request, and the step they belong to."""

    tensors: list[torch.Tensor]  # [1, kv_heads, cached_len_i, head_dim] each
    step: PackedCaches
    window: int | None  # this layer's sliding window (None: full attention)


class PackedCaches:
    """Quacks like a transformers Cache for one packed forward pass.

    It also holds what every layer's attention needs and what is the same for all of them: which rows decode,
    as a device tensor, and the masks, built on first use and reused by every later layer of the same kind. No
    layer builds a tensor from a Python list (on a GPU, a host-to-device copy per layer per step).
    """

    is_compileable = False

    def __init__(self, caches: Sequence[DynamicCache], spans: list[tuple[int, int]], device: torch.device,
                 windows: Sequence[int | None] | None = None, latent: bool = False,
                 starts: Sequence[int] | None = None, prefill: Sequence[bool] | None = None, views: bool = False,
                 groups: Sequence[tuple] | None = None, kernel: Any = None):
        """`starts` (each request's first absolute position) and `prefill` (whether it feeds prompt tokens): given
        under BATCH_INVARIANT, whose attention calls they fix (app/core/runner/pieces.py). `views`: attention is
        `packed_attention`, which reads an 8-bit cache's decode rows where they lie (QuantizedKV); other calls get
        dense keys and values. `groups`: per request, the image runs its chunk feeds whose tokens see each other
        both ways (Gemma 3, app/core/runner/image_groups.py), as offsets from its first position."""
        self.caches = list(caches)
        self.latent = latent  # MLA: `update` joins the requests' latents; `lengths` says where to cut them again
        self.lengths: dict[int, list[int]] = {}
        self.spans = spans
        self.windows = list(windows) if windows is not None else None
        self.decoding = [i for i, (start, end) in enumerate(spans) if end - start == 1]
        self.chunks = [i for i, (start, end) in enumerate(spans) if end - start > 1]
        self.decode_rows = torch.tensor([spans[i][0] for i in self.decoding], device=device)  # once per step
        self._masks: dict[tuple, torch.Tensor | None] = {}
        self._scratch: list[torch.Tensor | None] = [None, None]  # fp32 keys and values for decode rows (`fp32`)
        self.starts = list(starts) if starts is not None else None
        self.groups = [tuple(g) for g in groups] if groups is not None else [()] * len(spans)
        self.calls = invariant_calls(spans, self.starts, list(prefill), self.groups) if starts is not None else None
        self.views = views and self.calls is None and not latent
        self.kernel = kernel if self.calls is None else None  # app/models/decode_attention.py's, on a CPU, or None
        # The rows the kernel attends: each decode row, and each row of a short chunk past the prompt (a speculative
        # verify pass, whose SDPA call over a long cache cost more than the whole decode step) over the keys up to
        # its own position. (position in the pass, request, keys hidden from it); `small`: those chunks' requests.
        # A prompt chunk stays on SDPA whatever its size: its size depends on what else the step prefills, and a
        # token's attention must not.
        self.small = {i for i in self.chunks if spans[i][1] - spans[i][0] <= KERNEL_CHUNK and not self.groups[i]
                      and not latent and prefill is not None and not prefill[i]} if self.kernel is not None else set()
        self.kernel_rows = [(spans[i][0] + j, i, spans[i][1] - spans[i][0] - 1 - j) for i in sorted(
            set(self.decoding) | self.small) for j in range(spans[i][1] - spans[i][0])] if self.kernel else []
        self.kernel_positions = torch.tensor([row[0] for row in self.kernel_rows], dtype=torch.long, device=device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states, value_states: [1, kv_heads, T_total, head_dim] for all requests' new tokens."""
        keys, values = [], []
        for index, (cache, (start, end)) in enumerate(zip(self.caches, self.spans)):
            # a decode row (or a short chunk the kernel reads) of a KVStore: the cache's own views, maybe 8-bit
            views = self.views and (end - start == 1 or index in self.small) and hasattr(cache, "append")
            k, v = (cache.append if views else cache.update)(key_states[:, :, start:end],
                                                              value_states[:, :, start:end], layer_idx)
            keys.append(k)
            values.append(v)
        if self.latent:  # [1, 1, sum of cached lengths, latent or rotary size]: the model expands them itself
            self.lengths[layer_idx] = [k.shape[-2] for k in keys]
            return torch.cat(keys, dim=-2), torch.cat(values, dim=-2)
        window = self.windows[layer_idx] if self.windows is not None else None
        return PerRequest(keys, self, window), PerRequest(values, self, window)

    def split(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[PerRequest, PerRequest]:
        """An MLA layer's expanded keys and values, [1, heads, sum of cached lengths, d_k or d_v], cut back into
        requests."""
        lengths = self.lengths[layer_idx]
        window = self.windows[layer_idx] if self.windows is not None else None
        return (PerRequest(list(key.split(lengths, dim=-2)), self, window),
                PerRequest(list(value.split(lengths, dim=-2)), self, window))

    def fp32(self, tensor: torch.Tensor | QuantizedKV, slot: int) -> torch.Tensor:
        """`tensor` [1, kv_heads, n, d] cast (or dequantized) to fp32 in this pass's scratch `slot` (0 keys, 1
        values), which every layer and row reuses: a fresh tensor per layer and row cost its pages (measured ~10 ms
        a step at 4,096)."""
        numel = tensor.shape.numel()
        if self._scratch[slot] is None or self._scratch[slot].numel() < numel:
            self._scratch[slot] = torch.empty(numel, dtype=torch.float32, device=self.decode_rows.device)
        scratch = self._scratch[slot]  # an 8-bit cache's laid out as its codes lie, tokens innermost (`fp32_like`)
        return _write(fp32_like(tensor.codes, scratch) if isinstance(tensor, QuantizedKV)
                      else scratch[:numel].view(tensor.shape), tensor)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # never consulted: the caller passes explicit position ids and its own mask

    def decode_mask(self, lengths: list[int], window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask [B, 1, 1, width] for the decode rows' keys left-padded to one width: padding, and keys
        a sliding window has left behind, are masked out."""
        key = ("decode", tuple(lengths), window, dtype)
        if key not in self._masks:
            width = max(lengths)
            mask = torch.zeros(len(lengths), 1, 1, width, dtype=dtype, device=self.decode_rows.device)
            for i, length in enumerate(lengths):
                visible = length if window is None else min(length, window)
                mask[i, ..., : width - visible] = torch.finfo(dtype).min
            self._masks[key] = mask
        return self._masks[key]

    def eager_mask(self, n: int, total: int, window: int | None, dtype: torch.dtype, groups: tuple = (),
                   ahead: int = 0) -> torch.Tensor:
        """Additive mask [1, 1, n, total] as transformers' eager masks are (0 seen, the dtype's min hidden): the
        chunk's causal (and sliding-window) rule spelled out, since eager attention has no causal rule of its
        own."""
        key = ("eager", n, total, window, dtype, groups, ahead)
        if key not in self._masks:
            seen = self.chunk_mask(n, total, window, groups, ahead)
            if seen is None:
                ones = torch.ones(n, total, dtype=torch.bool, device=self.decode_rows.device)
                seen = ones.tril(total - n)[None, None]
            self._masks[key] = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(
                ~seen, torch.finfo(dtype).min)
        return self._masks[key]

    def chunk_mask(self, n: int, total: int, window: int | None, groups: tuple = (),
                   ahead: int = 0) -> torch.Tensor | None:
        """Boolean mask [1, 1, n, total] for a prefill chunk of n queries over `total` keys (its own n last, then
        `ahead` more), as HF's causal (and sliding-window) masks say; None where plain causal attention is exactly
        that. `groups`: image runs (first, end), offsets from the first query, whose tokens see each other both ways
        (Gemma 3), as its forward composes them: (causal OR same run) AND window."""
        if window is not None and window >= total:
            window = None  # the window reaches past every key: it hides nothing
        if n == total and window is None and not groups:
            return None  # no earlier cache: exactly what a solo prefill passes (no mask, causal)
        key = ("chunk", n, total, window, groups, ahead)
        if key not in self._masks:
            ones = torch.ones(n, total, dtype=torch.bool, device=self.decode_rows.device)
            first = total - ahead - n  # query i sits at key position first + i: it sees keys up to there (causal)
            mask = ones.tril(first)
            for a, b in groups:  # ... and every key of its image run, later ones too ...
                mask[max(a, 0) : b, max(first + a, 0) : first + b] = True
            if window is not None:  # ... and, in a sliding window, only the `window` latest of them
                mask &= ~ones.tril(first - window)
            self._masks[key] = mask[None, None]
        return self._masks[key]


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """query: [1, heads, T_total, head_dim]. Each request attends only to its own keys."""
    if (step := kwargs.pop(PACKED_STEP, None)) is not None and not isinstance(key, PerRequest):
        key, value = step.split(key, value, module.layer_idx)  # MLA: expanded from the joined latents
    if not isinstance(key, PerRequest):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    step, window = key.step, key.window
    if step.calls is not None:  # BATCH_INVARIANT
        def attend(q, k, v, call: Call) -> torch.Tensor:
            if call.as_decode and decode_matmuls(q.device, q.dtype):  # a decode row, as the batched path takes it
                o = grouped_decode_attention(q, k.float(), v.float(), None, scaling or q.shape[-1] ** -0.5)
                return o[:, None].to(q.dtype)  # [1, 1, heads, d_v]
            mask = None if call.as_decode else step.chunk_mask(q.shape[2], k.shape[-2], window, call.groups, call.ahead)
            return sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling)[0]

        return attend_in_calls(step.calls, step.starts, step.spans, query, key.tensors, value.tensors, window,
                               attend), None
    # [1, T_total, heads, value head_dim]: MLA's values are not the size of its keys and queries
    out = query.new_empty(1, query.shape[2], query.shape[1], value.tensors[0].shape[-1])
    if step.kernel_rows:  # every decode row and short chunk's row in one call, over its keys where they lie
        keys = [_shown(_upto(key.tensors[i], hidden), window) for _, i, hidden in step.kernel_rows]
        values = [_shown(_upto(value.tensors[i], hidden), window) for _, i, hidden in step.kernel_rows]
        q = query[0, :, step.kernel_positions].transpose(0, 1)  # [rows, heads, head_dim]
        out[0, step.kernel_positions] = step.kernel.attend(q, keys, values, scaling or q.shape[-1] ** -0.5).to(
            query.dtype)
    elif step.decoding:
        q = query[0, :, step.decode_rows, None, :].transpose(0, 1)  # [B, heads, 1, head_dim]
        # an 8-bit cache's rows take the fp32 matmuls whatever the dtype: they dequantize into the fp32 scratch
        quantized = any(isinstance(key.tensors[i], QuantizedKV) for i in step.decoding)
        matmuls, scale = decode_matmuls(query.device, query.dtype) or quantized, scaling or q.shape[-1] ** -0.5
        lengths = [key.tensors[i].shape[-2] for i in step.decoding]
        if matmuls and (len(lengths) == 1 or max(lengths) > PAD_UP_TO):  # each row over its keys where they lie
            for b, i in enumerate(step.decoding):
                k, v = key.tensors[i], value.tensors[i]  # [1, kv_heads, len_i, d]
                if window is not None:  # the keys a sliding window still shows
                    k, v = k[..., -window:, :], v[..., -window:, :]
                o = grouped_decode_attention(q[b : b + 1], step.fp32(k, 0), step.fp32(v, 1), None, scale)
                out[0, step.spans[i][0]] = o[0].to(query.dtype)
        else:  # one call for all rows, their keys left-padded to one width, padding masked out
            dtype = torch.float32 if matmuls else query.dtype
            k, v = _left_padded([key.tensors[i] for i in step.decoding], [value.tensors[i] for i in step.decoding],
                                dtype)
            mask = step.decode_mask(lengths, window, dtype)
            if matmuls:
                out[0, step.decode_rows] = grouped_decode_attention(q, k, v, mask, scale).to(query.dtype)
            else:
                o, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling)
                out[0, step.decode_rows] = o[:, 0]  # [B, 1, heads, d]
    for i in step.chunks:  # each prefill chunk: its own call, unpadded
        if i in step.small:
            continue
        start, end = step.spans[i]
        k, v = key.tensors[i], value.tensors[i]
        mask = step.chunk_mask(end - start, k.shape[-2], window, step.groups[i])
        o, _ = sdpa_attention_forward(module, query[:, :, start:end], k, v, mask, dropout=dropout, scaling=scaling)
        out[:, start:end] = o
    return out, None


def _upto(tensor, hidden: int):
    """The keys or values [1, kv_heads, n, d] a row sees when the last `hidden` are its chunk's later tokens."""
    return tensor[:, :, : tensor.shape[-2] - hidden] if hidden else tensor


def _shown(tensor, window: int | None):
    """The keys or values [1, kv_heads, n, d] a sliding window still shows (all of them without one)."""
    return tensor if window is None else tensor[:, :, -window:]


def _left_padded(keys: list[torch.Tensor], values: list[torch.Tensor],
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, kv_heads, len_i, d_k or d_v] each -> [B, kv_heads, width, d_k or d_v] each in `dtype`, zeros on the
    left (see `decode_mask`)."""
    width = max(k.shape[-2] for k in keys)
    _, heads, _, dim = keys[0].shape
    device = (keys[0].codes if isinstance(keys[0], QuantizedKV) else keys[0]).device
    k_out = torch.zeros(len(keys), heads, width, dim, dtype=dtype, device=device)
    v_out = torch.zeros(len(keys), heads, width, values[0].shape[-1], dtype=dtype, device=device)
    for i, (k, v) in enumerate(zip(keys, values)):
        pad = width - k.shape[-2]
        _write(k_out[i, :, pad:], k[0])
        _write(v_out[i, :, pad:], v[0])
    return k_out, v_out


def _write(out: torch.Tensor, source: torch.Tensor | QuantizedKV) -> torch.Tensor:
    """`source`'s values into `out` (of its shape): copied, or dequantized from an 8-bit cache."""
    return source.dequantize(out.dtype, out=out) if isinstance(source, QuantizedKV) else out.copy_(source)


def packed_eager_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """As `packed_attention`, on the model's own eager function (soft-capping, sinks: whatever its module does),
    one request at a time: query [1, heads, T_total, head_dim]."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    if not isinstance(key, PerRequest):  # a solo pass: exactly the model's own eager attention
        return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    step, window = key.step, key.window
    if step.calls is not None:  # BATCH_INVARIANT: the same per-request calls, on the eager function
        def attend(q, k, v, call: Call) -> torch.Tensor:
            # a decode row's keys are cut already
            mask = step.eager_mask(q.shape[2], k.shape[-2], window, q.dtype, call.groups, call.ahead)
            return eager(module, q, k, v, mask, dropout=dropout, scaling=scaling, **kwargs)[0]

        return attend_in_calls(step.calls, step.starts, step.spans, query, key.tensors, value.tensors, window,
                               attend), None
    out = query.new_empty(1, query.shape[2], query.shape[1], value.tensors[0].shape[-1])
    for i, (start, end) in enumerate(step.spans):
        k, v = key.tensors[i], value.tensors[i]
        mask = step.eager_mask(end - start, k.shape[-2], window, query.dtype, step.groups[i])
        out[:, start:end], _ = eager(module, query[:, :, start:end], k, v, mask, dropout=dropout, scaling=scaling,
                                     **kwargs)
    return out, None


AttentionInterface.register(PACKED, packed_attention)
AttentionMaskInterface.register(PACKED, sdpa_mask)  # solo calls get exactly the masks SDPA would get
AttentionInterface.register(PACKED_EAGER, packed_eager_attention)
AttentionMaskInterface.register(PACKED_EAGER, eager_mask)  # and here the masks eager attention would get


_WINDOWS: WeakKeyDictionary = WeakKeyDictionary()


def attention_windows(model) -> list[int | None] | None:
    """Per layer: None for full attention, the window for a sliding one; None overall when some layer is of a
    kind the packed pass cannot mask (chunked attention, linear attention, shared or no KV).

    The layer kinds are read as transformers reads them to build a DynamicCache, so that a Mistral-style config
    (a `sliding_window` and no `layer_types`) counts as sliding in every layer, exactly as its model masks it.
    """
    if model not in _WINDOWS:
        config = model.config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
        windows: list[int | None] | None = []
        for layer_type, kwargs in zip(layer_types, layer_kwargs):
            if layer_type == "full_attention":
                windows.append(None)
            elif layer_type == "sliding_attention":
                windows.append(kwargs["sliding_window"])
            else:
                windows = None
                break
        _WINDOWS[model] = windows
    return _WINDOWS[model]


def enable_packed_batching(model, decode_kernel: Any = None) -> bool:
    """Switch an SDPA model to `packed_attention`, an eager one to `packed_eager_attention` (each identical for solo
    calls), `decode_kernel` (app/models/decode_attention.py: ours or torch's) attending its decode rows on a CPU.
    False: keep one request per pass."""
    implementation = model.config._attn_implementation
    if attention_windows(model) is None:
        return False  # attention the packed masks do not express: one request per pass
    if implementation in ("sdpa", PACKED):
        model.set_attn_implementation(PACKED)
        if decode_kernel is not None and decode_kernel.ours:
            _DECODE_KERNELS[model] = decode_kernel
        return True
    if implementation in ("eager", PACKED_EAGER) and hasattr(sys.modules[type(model).__module__],
                                                              "eager_attention_forward"):
        model.set_attn_implementation(PACKED_EAGER)
        return True
    return False  # another kernel (flash attention, say): one request per pass


def decode_kernel(model) -> Any:
    """The kernel `enable_packed_batching` gave this model's decode rows, or None (torch's ops)."""
    return _DECODE_KERNELS.get(model)


def packed_inputs(items: Sequence[tuple[torch.Tensor, int]], device: torch.device) -> dict[str, Any]:
    """items: (token ids [n_i], first position) per request -> model inputs for one packed row."""
    ids = torch.cat([tokens for tokens, _ in items])[None, :]  # [1, T_total]
    positions = torch.cat([torch.arange(start, start + len(tokens), device=device) for tokens, start in items])
    spans, offset = [], 0
    for tokens, _ in items:
        spans.append((offset, offset + len(tokens)))
        offset += len(tokens)
    # A ready-made 4D mask makes transformers skip building its own; packed_attention makes per-request masks.
    placeholder_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
    return {"input_ids": ids, "position_ids": positions[None, :], "spans": spans, "attention_mask": placeholder_mask}
