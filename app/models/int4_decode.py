"""QUANT=int4's own CPU kernel (INT4_KERNEL): 4-bit weights times activations quantized to 8 bits, in integers.

torch's `aten._weight_int4pack_mm_for_cpu` takes bf16 activations and turns every 4-bit weight back into a float
inside its loop. llama.cpp instead quantizes the activations to int8 per block of 32 and multiplies integers
(AVX512-VNNI's `vpdpbusd`, AVX2's `vpmaddubsw`) over weights repacked once at load, and led us at one stream.
`int4_decode.cpp` does the same: per group of 32 inputs, dot = scale_w x scale_x x sum(code x q) + min_w x scale_x
x sum(q), the integer sum exact and the rest in fp32 in one fixed order, so its three paths (AVX512-VNNI, AVX2, a
plain C++ reference) give the same bits, and a row the same bits at any row count (BATCH_INVARIANT holds). The
weights are held once, in the kernel's layout: 4-bit codes of 16 rows interleaved per group, fp16 scale and
minimum, the bytes of aten's layout (5 bits a weight). torchao's CPU kernels do this too, but its wheel here
carries CUDA kernels only, so the kernel is ours.

Measured on a Zen 4 EPYC (AVX-512 on 256-bit units, VNNI; one layer alone, 1 thread, docs/performance.md): both
paths faster than aten's kernel at every shape tried, at 1 and 8 rows and in single runs at 16, 64 and 128, so
prefill runs on it too and no second layout is kept. Other CPU classes (AVX2-only, Zen 5, AMX Xeons) are
unmeasured; INT4_KERNEL=aten keeps torch's kernel.

The extension is compiled with torch's `cpp_extension` by `make setup`, or at the first int4 load on a machine
(36-46 s with g++ 12 here), into ~/.cache/simple-serve/kernels/, then loaded from there. Each path is compiled for
its own instructions (target attributes), so one build serves every x86 CPU and the path is chosen at run time from
what the CPU has (`cpu_features`, which honours ATEN_CPU_CAPABILITY). Where it cannot build (no compiler, no ninja)
or the CPU has neither VNNI nor AVX2, int4 stays on aten's kernel and the start log says why.
"""

from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path
from typing import Any

import torch

from app.models.cpu import cpu_features
from app.models.cpu_kernels import CpuKernel, build, open_path

log = logging.getLogger("app.models.int4_decode")

INT4_KERNELS = ("auto", "vnni", "avx2", "reference", "aten")
PATHS = {"reference": 0, "avx2": 1, "vnni": 2}  # int4_decode.cpp's path numbers
SOURCE = Path(__file__).with_name("int4_decode.cpp")
INCLUDES = (Path(__file__).with_name("int8_groups.h"),)  # a GGUF's 5- to 8-bit blocks on the same arithmetic


def extension() -> tuple[Any, str | None]:
    """The compiled int4_decode.cpp, or None and why not."""
    return build("simple_serve_int4_decode", SOURCE, INCLUDES)


class Int4Kernel(CpuKernel):
    """What `Int4Linear` multiplies with: a path of int4_decode.cpp, or "aten" (torch's kernel), and why."""

    PATHS = PATHS

    def pack(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
        """codes int32 [out, in], `fp16_scales` -> the kernel's layout, one uint8 buffer."""
        return self.module.pack(codes, scale, minimum)

    def matmul(self, rows: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """rows [M, in], fp32 or bf16 -> [M, out] in their dtype."""
        return self.module.matmul(rows, packed, out_features, PATHS[self.name])

    def pack8(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
        """codes int8 [out, in], scale fp16 [out, in / 16], minimum fp16 [out, in / 32] -> int8_groups.h's layout."""
        return self.module.pack8(codes, scale, minimum)

    def matmul8(self, rows: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """rows [M, in], fp32 or bf16 -> [M, out] in their dtype, over `pack8`'s weights."""
        return self.module.matmul8(rows, packed, out_features, PATHS[self.name])


def fp16_scales(scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scales_and_zeros [in / 32, out, 2] as `int4_weight` makes them (a weight is (code - 8) x scale + zero) ->
    (scale, minimum), fp16 [out, in / 32]: the kernel's weight is code x scale + minimum."""
    scale, zero = scales_and_zeros.float().unbind(-1)
    return scale.t().half().contiguous(), (zero - 8 * scale).t().half().contiguous()


@functools.cache
def choose_int4_kernel(asked: str = "auto") -> Int4Kernel:
    """INT4_KERNEL=`asked`: auto takes VNNI where the CPU has AVX512-VNNI, else AVX2; a path asked for by name runs
    where the CPU has its instructions (tests run each one); anything that cannot run gives aten, with the reason."""
    if asked not in INT4_KERNELS:
        raise ValueError(f"int4_kernel must be one of {', '.join(INT4_KERNELS)}, not {asked!r}")
    if asked == "aten":
        return Int4Kernel("aten", "INT4_KERNEL=aten")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return Int4Kernel("aten", f"our int4 kernel is for x86 CPUs, this is {platform.machine()}")
    cpu = cpu_features()
    name = asked
    if asked == "auto":
        if "avx512_vnni" in cpu.flags:
            name = "vnni"
        elif cpu.aten_capability in ("AVX2", "AVX512"):
            name = "avx2"
        else:
            return Int4Kernel("aten", f"cpu {cpu.describe()} has neither AVX512-VNNI nor AVX2")
    module, why = open_path("INT4_KERNEL", asked, name, PATHS, extension,
                            {"vnni": "AVX512-VNNI", "avx2": "AVX2", "reference": "the plain C++ reference, slow,"})
    if module is None:
        log.warning("quant=int4: our kernel cannot run here: %s; aten's int4 kernel instead", why)
        return Int4Kernel("aten", why)
    return Int4Kernel(name, why, module)
