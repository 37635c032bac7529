"""Decode attention's CPU kernel (DECODE_ATTENTION): one query row per request over its cache where it lies.

A decode row's attention reads every key and value its request holds. The torch version
(`grouped_decode_attention`, app/core/runner/torch_decode.py) first casts them, or dequantizes an 8-bit cache, into an
fp32 scratch, per layer and step, then runs two matmuls and a softmax as separate ops: at 4,096 tokens that copy
and the ops around it cost more than the reads themselves. `decode_attention.cpp` makes one pass per KV head over
the cache as it is kept (bf16, fp16, fp32, or int8 codes with their fp16 scales), scores, softmax and values in
fp32, every decode row of a pass in one call with no padding. Its three paths (AVX-512, AVX2, a baseline build)
are one C++ body compiled for each; they round their fp32 sums in different orders, so tests bound each against
the torch version rather than against each other.

Where the kernel cannot run (no compiler, not x86, DECODE_ATTENTION=torch), decode rows keep the torch version,
and the start log says why. On a GPU or in fp32 the decode rows take SDPA as before; the kernel is for the CPU's
half-precision and 8-bit caches.
"""

from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path
from typing import Any, Sequence

import torch

from app.models.cpu import cpu_features
from app.models.cpu_kernels import CpuKernel, build, open_path

log = logging.getLogger("app.models.decode_attention")

DECODE_ATTENTIONS = ("auto", "avx512", "avx2", "reference", "torch")
PATHS = {"reference": 0, "avx2": 1, "avx512": 2}  # decode_attention.cpp's path numbers
SOURCE = Path(__file__).with_name("decode_attention.cpp")
DENSE = torch.empty(0, dtype=torch.float16)  # "no scales": the part is kept in a float dtype


_LOADED: list[Any] = []  # the extension, once a load has chosen it in this process


def extension() -> tuple[Any, str | None]:
    """The compiled decode_attention.cpp, or None and why not."""
    return build("simple_serve_decode_attention", SOURCE, (SOURCE.with_name("decode_attention_body.h"),))


def loaded_kernel() -> Any:
    """The extension where a load in this process chose our kernel, else None (never builds it). An 8-bit cache
    quantizes new tokens with its `quantize_into`, the same bits as kv_store's torch ops in one call instead of a
    dozen (~50 µs a layer and token there)."""
    return _LOADED[0] if _LOADED else None


class AttentionKernel(CpuKernel):
    """What decode rows attend with: a path of decode_attention.cpp, or "torch", and why."""

    PATHS = PATHS

    def attend(self, q: torch.Tensor, keys: Sequence[Any], values: Sequence[Any], scaling: float) -> torch.Tensor:
        """q [B, heads, d]; keys[b] and values[b] [1, kv_heads, n_b, d] tensors or `QuantizedKV`s, as a request's
        cache hands them out -> [B, heads, d_v] fp32."""
        key_codes, key_scales = _parts(keys)
        value_codes, value_scales = _parts(values)
        return self.module.attend(q.float().contiguous(), key_codes, key_scales, value_codes, value_scales,
                                  float(scaling), PATHS[self.name])

    def describe(self) -> str:
        return f"{'our kernel' if self.ours else 'torch'} ({self.why})"


def _parts(parts: Sequence[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    codes, scales = [], []
    for part in parts:
        quantized = hasattr(part, "scales")  # an 8-bit cache's QuantizedKV
        codes.append((part.codes if quantized else part)[0])
        scales.append(part.scales[0] if quantized else DENSE)
    return codes, scales


@functools.cache
def choose_attention_kernel(asked: str = "auto") -> AttentionKernel:
    """DECODE_ATTENTION=`asked`: auto takes AVX-512 where ATen may use it, else AVX2, else torch; a path asked for
    by name runs where the CPU has its instructions (tests run each one); anything that cannot run gives torch."""
    if asked not in DECODE_ATTENTIONS:
        raise ValueError(f"decode_attention must be one of {', '.join(DECODE_ATTENTIONS)}, not {asked!r}")
    if asked == "torch":
        return AttentionKernel("torch", "DECODE_ATTENTION=torch")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return AttentionKernel("torch", f"our decode attention kernel is for x86 CPUs, this is {platform.machine()}")
    cpu = cpu_features()
    name = asked
    if asked == "auto":
        if cpu.aten_capability == "AVX512":
            name = "avx512"
        elif cpu.aten_capability == "AVX2":
            name = "avx2"
        else:
            return AttentionKernel("torch", f"cpu {cpu.describe()} has neither AVX-512 nor AVX2")
    module, why = open_path("DECODE_ATTENTION", asked, name, PATHS, extension,
                            {"avx512": "AVX-512", "avx2": "AVX2", "reference": "the baseline build, slow,"})
    if module is None:
        log.warning("decode attention: our kernel cannot run here: %s; the torch version instead", why)
        return AttentionKernel("torch", why)
    _LOADED[:] = [module]
    return AttentionKernel(name, why, module)
