"""What this CPU can run, as torch and oneDNN will run it. Decides `dtype=auto`, where prepacking can run at all, and
which int8 engine QUANT=int8 uses; never a timing (whether prepacking *pays* is measured, app/models/prepack.py).

Three rules, all from CPU features only, so the same machine and settings load the same way on every start:
- bf16 weights on the CPU only where the CPU has native bf16 dot products (AVX512_BF16's `vdpbf16ps`, or AMX-BF16).
  Without them a bf16 matmul converts to fp32 first: on an AVX2-only EPYC one 896x4864 linear took 54 ms in bf16
  against 8.4 ms in fp32 at 128 rows. With them, bf16 prepacked won at 1, 8, 32 and 128 rows here
  (docs/performance.md), so there is no row count at which fp32 would be the better default.
- oneDNN's bf16 weight reorder (prepacking) needs AVX512BW+VL+DQ or AVX-NE-CONVERT; torch raises without them. Its
  fp32 reorder (a copy for batched rows, app/models/batch_rows.py) runs wherever oneDNN does.
- int8 (`int8_engine`): fbgemm (AVX512-VNNI or AVX2) wherever torch has it. It measured faster than oneDNN at
  decode sizes (Zen 5, AVX512-VNNI: 0.016 against 0.026 ms for one 896x896 row), and its packed weight is all it
  holds, where torch's oneDNN packed weight keeps the int8 original beside it: 2 bytes a weight, bf16's, which is
  the memory QUANT=int8 exists to save. So an AMX CPU gets fbgemm too (AMX-INT8 unused: fbgemm has no AMX kernels,
  pytorch/tutorials#2439); oneDNN only where torch has no fbgemm.

The flags are read as torch will use them: `ATEN_CPU_CAPABILITY=avx2` hides AVX-512 from ATen's kernels, and
`ONEDNN_MAX_CPU_ISA=AVX2` caps oneDNN. We honour both, so an AVX2-only machine can be emulated on any x86 CPU
(`make test` does, for the loading/dtype/generate tests).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import cache

import torch

# oneDNN's cpu_isa bit masks (dnnl_cpu_isa_t): an ISA includes another when it holds all of its bits.
ONEDNN_ISAS = {
    "SSE41": 0x1, "AVX": 0x3, "AVX2": 0x7, "AVX2_VNNI": 0xF, "AVX2_VNNI_2": 0x1F, "AVX512_CORE": 0x27,
    "AVX512_CORE_VNNI": 0x67, "AVX512_CORE_BF16": 0xE7, "AVX10_1_512": 0x1EF, "AVX512_CORE_FP16": 0x1EF,
    "AVX10_1_512_AMX": 0xFEF, "AVX512_CORE_AMX": 0xFEF, "AVX10_1_512_AMX_FP16": 0x1FEF, "AVX512_CORE_AMX_FP16": 0x1FEF,
}
# The least oneDNN ISA under which each CPU flag is used.
FLAG_NEEDS_ISA = {"avx_ne_convert": 0x1F, "avx512_bw": 0x27, "avx512_vl": 0x27, "avx512_dq": 0x27,
                  "avx512_vnni": 0x67, "avx512_bf16": 0xE7, "amx_tile": 0xFEF, "amx_bf16": 0xFEF, "amx_int8": 0xFEF}
# /proc/cpuinfo's names for them, where they differ (torch.cpu.get_capabilities() uses the names above).
CPUINFO_NAMES = {"avx512bw": "avx512_bw", "avx512vl": "avx512_vl", "avx512dq": "avx512_dq"}


@dataclass(frozen=True)
class CpuFeatures:
    name: str
    aten_capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX512", "AVX2", "DEFAULT", ...
    onednn_max_isa: str | None  # ONEDNN_MAX_CPU_ISA as set, or None
    flags: frozenset[str]  # the flags below that this CPU has and that torch and oneDNN are allowed to use
    onednn_bf16: bool  # torch's own answer: can oneDNN run bf16 here (honours ONEDNN_MAX_CPU_ISA)
    forced: tuple[str, ...] = ()  # the env vars that lowered what torch and oneDNN may use, as "NAME=value"

    @property
    def native_bf16(self) -> str | None:
        """Which instructions give native bf16 dot products here, or None."""
        names = [label for flag, label in (("avx512_bf16", "AVX512_BF16"), ("amx_bf16", "AMX-BF16"))
                 if flag in self.flags]
        return " and ".join(names) or None

    @property
    def bf16_reorder(self) -> bool:
        """What oneDNN's bf16 weight reorder checks before it runs."""
        avx512 = {"avx512_bw", "avx512_vl", "avx512_dq"} <= self.flags
        return self.onednn_bf16 and (avx512 or "avx_ne_convert" in self.flags)

    def describe(self) -> str:
        return f"{self.name} ({self.aten_capability}" + (f", forced by {' '.join(self.forced)})" if self.forced else ")")


@cache
def cpu_features() -> CpuFeatures:
    """Read once per process: torch reads both env vars once too, at its first use of them."""
    caps = torch.cpu.get_capabilities() if platform.machine().lower() in ("x86_64", "amd64") else {}
    flags = {flag for flag in FLAG_NEEDS_ISA if caps.get(flag)}
    aten = torch.backends.cpu.get_cpu_capability()
    if not aten.startswith("AVX512"):  # ATen was kept below AVX-512 (forced, or an older CPU): so are we
        flags = {f for f in flags if not f.startswith(("avx512", "amx"))}
    isa_name = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper() or None
    cap = ONEDNN_ISAS.get(isa_name or "")  # DEFAULT, ALL or an ISA newer than this table: no cap
    if cap is not None:
        flags = {f for f in flags if FLAG_NEEDS_ISA[f] & cap == FLAG_NEEDS_ISA[f]}
    onednn_bf16 = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    name = str(caps.get("cpu_name") or platform.processor() or platform.machine())
    forced = tuple(f"{var}={os.environ[var]}" for var in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
                   if os.environ.get(var))
    return CpuFeatures(name=name, aten_capability=aten, onednn_max_isa=isa_name, flags=frozenset(flags),
                       onednn_bf16=onednn_bf16, forced=forced)


def features_from_cpuinfo(flags_line: str, name: str = "x86") -> CpuFeatures:
    """The features a CPU with this /proc/cpuinfo `flags` line would show torch, unforced: tests decide for CPU
    classes this machine is not (an AMX Xeon on an AMD host), since AMX cannot be emulated here (qemu's TCG has no
    AMX, nor AVX-512 in the qemu that `make test-avx2` uses)."""
    have = {CPUINFO_NAMES.get(f, f) for f in flags_line.removeprefix("flags").strip(" \t:").split()}
    avx512 = {"avx512f", "avx512_bw", "avx512_vl", "avx512_dq"} <= have  # what ATen's AVX512 kernels need
    aten = "AVX512" if avx512 else "AVX2" if {"avx2", "fma"} <= have else "DEFAULT"
    flags = {f for f in FLAG_NEEDS_ISA if f in have and (avx512 or not f.startswith(("avx512", "amx")))}
    return CpuFeatures(name=name, aten_capability=aten, onednn_max_isa=None, flags=frozenset(flags),
                       onednn_bf16=avx512 or "avx_ne_convert" in have)


def int8_engine(features: CpuFeatures | None = None,
                engines: tuple[str, ...] | list[str] | None = None) -> tuple[str | None, str]:
    """QUANT=int8's torch quantized engine for fp32 activations on this CPU, and why; None where none fits.

    The engine is fixed when a weight is prepacked (`quantized::linear_prepack` packs for the current engine), and
    each packed weight then runs its own engine's kernel."""
    cpu = features or cpu_features()
    engines = tuple(torch.backends.quantized.supported_engines if engines is None else engines)
    if cpu.aten_capability == "DEFAULT":
        return None, f"cpu {cpu.describe()} has no AVX2, which fbgemm and oneDNN's int8 kernels need"
    vnni = "AVX512-VNNI" if "avx512_vnni" in cpu.flags else "AVX2"
    for engine in ("x86", "fbgemm"):  # x86 runs linears on fbgemm, and is what torch picks by default
        if engine in engines:
            amx = ("; not oneDNN's AMX-INT8, whose packed weights keep their int8 original too (2 bytes a weight)"
                   if "amx_int8" in cpu.flags else "")
            return engine, f"fbgemm's {vnni} kernels (cpu {cpu.describe()}){amx}"
    if "amx_int8" in cpu.flags and "onednn" in engines:
        return "onednn", f"cpu {cpu.describe()} has AMX-INT8, which oneDNN uses, and this torch has no fbgemm"
    # Without fbgemm (a torch for another architecture) dynamic int8 stays off, as before: oneDNN's int8 is only
    # chosen where it has kernels fbgemm lacks.
    return None, f"this torch build has no fbgemm engine (it has {', '.join(engines) or 'none'})"


def auto_dtype(device: torch.device, features: CpuFeatures | None = None) -> tuple[torch.dtype, str]:
    """`dtype=auto`: the dtype for this device, and why, from its features alone."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, f"{torch.cuda.get_device_name(device)} supports bf16"
        return torch.float16, f"{torch.cuda.get_device_name(device)} has no bf16; fp16 is its half precision"
    if device.type != "cpu":
        return torch.float32, f"no bf16 rule for device {device.type}"
    cpu = features or cpu_features()
    if cpu.native_bf16:
        return torch.bfloat16, f"cpu {cpu.describe()} has native bf16 dot products ({cpu.native_bf16})"
    return torch.float32, (f"cpu {cpu.describe()} has no native bf16 dot products (AVX512_BF16 or AMX-BF16), "
                           "where bf16 matmuls are slower than fp32")


def prepack_support(device: torch.device, dtype: torch.dtype, features: CpuFeatures | None = None) -> str | None:
    """None if oneDNN's weight reorder can run here for this dtype; otherwise why not. bf16 weights are reordered in
    place (app/models/prepack.py), fp32 ones get a reordered copy for batched rows (app/models/batch_rows.py)."""
    if device.type != "cpu":
        return f"prepacking is for the CPU; the model is on {device.type}"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"prepacking applies to bfloat16 and float32 weights; these are {str(dtype).removeprefix('torch.')}"
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return "this torch build has no oneDNN weight reorder"
    if dtype == torch.float32:  # oneDNN has fp32 kernels wherever it runs
        return None
    cpu = features or cpu_features()
    if not cpu.bf16_reorder:
        return (f"cpu {cpu.describe()} lacks what oneDNN's bf16 reorder needs "
                "(AVX512BW+AVX512VL+AVX512DQ, or AVX-NE-CONVERT)")
    return None
