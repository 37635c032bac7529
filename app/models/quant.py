"""`QUANT=int8`: every linear layer, lm_head included, reads int8 weights with one scale per output channel.

A decode step reads every weight once, so on a CPU its speed is bytes read / memory bandwidth: int8 reads a quarter
of fp32's bytes and half of bf16's. Two of torch's own kernels do the work, chosen by what the model runs in:
- fp32 activations on an x86 CPU with AVX2 or better: dynamic int8, `quantized::linear_dynamic`.
  Each call quantizes its input to uint8, row by row (see DynamicInt8Linear), and multiplies int8 x uint8 with
  int32 sums. It is the fastest here at every batch size (measured: 0.15 ms against fp32's 0.42 ms for one
  896 x 4864 row, 0.25 against 1.57 ms for 8 rows). Its engine follows the CPU (app/models/cpu.py `int8_engine`):
  fbgemm's AVX512-VNNI or AVX2 kernels, on an AMX CPU too (oneDNN's AMX-INT8 packing keeps the int8 original
  beside its packed weight: 2 bytes a weight); oneDNN only where torch has no fbgemm and the CPU has AMX-INT8.
- anything else (bf16/fp16 activations, CUDA, a CPU without fbgemm): weight-only int8,
  `aten._weight_int8pack_mm`, which dequantizes the weight on the fly and keeps the activations as they are.
  It has CPU kernels for every capability (AVX2, AVX-512, plain) and a CUDA kernel.

`QUANT=int4`: the decoder's linear layers read 4-bit weights instead (app/models/quant_int4.py), the lm_head int8,
on the dynamic kernel wherever one runs, in bf16 too (`LinearQuantizer`).

None is exact. The embedded models' weights were dequantized from 4-bit GGUF, so each row holds few distinct
values and an int8 grid per row represents them almost exactly; dynamic int8 adds rounding of the activations on
top. `python -m benchmarks quality` measures both effects (perplexity on a fixed text and greedy agreement with the
unquantized model) and docs/performance.md lists the figures.

Nothing of the loaded floats stays behind. transformers maps the checkpoint's file and hands out views of it, so
while any tensor is such a view (a norm's weight, the embedding table) the file stays mapped, and every page that
quantizing read counts in the server's RSS: 2,128 MiB of the 0.5B model's fp32 file with QUANT=int8 (here, on
Zen 2). So after the swap every tensor left gets memory of its own (`keep_own_copies`) and the mapping closes.
The input embedding table is held once, as int8 rows (app/models/quant_embedding.py); a tied lm_head on the
weight-only kernel multiplies those rows. Under the dynamic kernel (fp32) the tied head still takes the weight-only
one on the shared rows, in bf16, where the CPU multiplies bf16 natively: 4.1 ms for Qwen2.5-0.5B's 151,936 x 896
head at one row against fbgemm's 2.4, 8.7 against 5.5 at 8 rows (the weight-only kernel in fp32: 45 ms), for 130 MiB
less (Zen 5; served, one stream as fast, 8 streams 0.78x and 0.94x in two A/B runs; docs/performance.md
"Memory"). Without native bf16 the head gets int8 rows of its own, beside the table's, as llama.cpp's GGUF files
keep `output.weight`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from typing import Callable, Iterator

import torch
from torch import nn

from app.models.cpu import cpu_features, int8_engine
from app.models.linears import plain_linears
from app.models.quant_embedding import Int8Embedding, per_row_int8
from app.models.int4_decode import Int4Kernel, choose_int4_kernel
from app.models.quant_group8 import GroupInt8Linear
from app.models.quant_int4 import INT4_GROUP, Int4Linear, int4_kernel_missing

log = logging.getLogger("app.models.quant")

QUANT_MODES = ("none", "int8", "int4")


def dynamic_int8_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """fbgemm and oneDNN's int8 kernels need AVX2; without them torch has no fast dynamic int8 path."""
    return device.type == "cpu" and dtype == torch.float32 and int8_engine()[0] is not None


@functools.cache
def fbgemm_has_vnni() -> bool:
    """Whether fbgemm multiplies uint8 x int8 with AVX-512 VNNI, which sums the products in int32.

    Without VNNI (AVX2, or AVX-512 without it) fbgemm uses `vpmaddubsw`, which adds two u8 x s8 products in a
    saturating int16: 2 x 255 x 127 overflows it. There the activations must be quantized to 7 bits
    (`reduce_range`), as torch's own default qconfig does everywhere. Found by the emulated AVX2 CPU of
    `make test-avx2`: with full-range activations the tiny model's logits were 9% off fp32 instead of ~1%.
    fbgemm reads CPUID itself (ATEN_CPU_CAPABILITY does not reach it), so this does too.
    """
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("avx512_vnni"))


class WeightOnlyInt8Linear(nn.Module):
    """Drop-in `nn.Linear`: int8 weights, activations kept in their own dtype (bf16, fp16 or fp32)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype | None = None,  # dtype: the activations' (the weight's)
                 quantized: tuple[torch.Tensor, torch.Tensor] | None = None):  # per_row_int8's, made already
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scales = quantized or per_row_int8(linear.weight)
        self.register_buffer("weight_int8", weight)  # [out, in]
        self.register_buffer("scales", scales.to(dtype or linear.weight.dtype))  # the kernel wants the activations' dtype
        self.bias = linear.bias
        self.weight_bytes = weight.numel() + scales.numel() * scales.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out], in x's dtype
        rows = x.reshape(-1, self.in_features).to(self.scales.dtype)  # a no-op but for an fp32 model's bf16 head
        out = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class DynamicInt8Linear(nn.Module):
    """Drop-in `nn.Linear` (CPU, fp32): int8 weights prepacked for fbgemm, activations quantized per call, per row.

    fbgemm quantizes a call's whole input with one scale. In a prefill chunk one token can carry activations 50x
    the others' (the first token's, in the MLP's down projection), and with a shared scale every other row lost
    most of its precision: perplexity +10.7% against fp32 on Qwen2.5-Coder-0.5B (`bench quality`), and 37-44%
    relative error on the ordinary rows of a 128-row call in a micro-benchmark. So each row is first divided by its
    own largest |value|, which puts every row on the same [-1, 1] scale, and the result multiplied back: a per-row
    quantization with fbgemm's own kernel (perplexity then +1.15%; one call per row measured +0.13%, but costs a
    call per row). A single row (a one-stream decode step) is its own tensor, so it skips the two extra passes
    (~20 us a call, ~3 ms a decode step).

    `anchored` (BATCH_INVARIANT): even per-row peaks leave the call's one scale and zero point to the rows' own
    minimum and maximum, so a row's codes still depend on its neighbours. So every call, one row included, appends
    one anchor row [+1, -1, 0, ...]: with every row divided by its peak, the call's minimum and maximum are then
    exactly -1 and +1, the scale and zero point always the same, and the integer sums exact, so a row comes out the
    same, bit for bit, at any row count. The anchor's output row is dropped.
    """

    def __init__(self, linear: nn.Linear, engine: str | None = None, anchored: bool = False,
                 quantized: tuple[torch.Tensor, torch.Tensor] | None = None):  # per_row_int8's, made already
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scales = quantized if quantized is not None else per_row_int8(linear.weight)
        with warnings.catch_warnings():  # torch flags quantized tensors as deprecated; the kernel has no other input
            warnings.simplefilter("ignore")
            qweight = torch._make_per_channel_quantized_tensor(weight, scales.double(),
                                                               torch.zeros_like(scales, dtype=torch.long), 0)
            # Packed for the engine current now; the packed weight keeps its engine's kernel from then on.
            self.engine = engine or torch.backends.quantized.engine
            with _quantized_engine(self.engine):
                self.packed = torch.ops.quantized.linear_prepack(qweight, None)  # the bias: added after the rescale
        # 7-bit activations where the kernel would add u8 x s8 pairs in a saturating int16 (no VNNI); oneDNN honours
        # ONEDNN_MAX_CPU_ISA, fbgemm reads CPUID (ONEDNN_MAX_CPU_ISA=AVX2 on a VNNI CPU gave 9% off with oneDNN).
        vnni = {"avx512_vnni", "amx_int8"} & cpu_features().flags if self.engine == "onednn" else fbgemm_has_vnni()
        self.reduce_range = not vnni
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.weight_bytes = weight.numel() + scales.numel() * 4
        # torch's oneDNN packed weight keeps the int8 original beside its packed copy (for unpack): 2 bytes a weight
        # (measured: 129 MiB of RSS for 64 MiB of int8 weights; fbgemm's 64), which is why fbgemm is the default.
        self.copy_bytes = weight.numel() if self.engine == "onednn" else 0
        self.anchor: torch.Tensor | None = None  # [1, in]: +1, -1, then zeros
        if anchored:
            self.anchor = torch.zeros(1, self.in_features)
            self.anchor[0, :2] = torch.tensor([1.0, -1.0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out] fp32
        x, reduce_range = x.float(), self.reduce_range  # a bf16 hidden state: QUANT=int4's lm_head
        if self.anchor is not None:
            rows = x.reshape(-1, self.in_features)
            peak = rows.abs().amax(dim=-1, keepdim=True).clamp_(min=torch.finfo(x.dtype).tiny)
            scaled = torch.cat([rows / peak, self.anchor])  # [rows + 1, in], within [-1, 1]: the anchor spans it
            out = torch.ops.quantized.linear_dynamic(scaled, self.packed, reduce_range)[:-1].mul_(peak)
            out = out.reshape(*x.shape[:-1], self.out_features)
        elif x.numel() == x.shape[-1]:
            out = torch.ops.quantized.linear_dynamic(x, self.packed, reduce_range)
        else:
            peak = x.abs().amax(dim=-1, keepdim=True).clamp_(min=torch.finfo(x.dtype).tiny)
            out = torch.ops.quantized.linear_dynamic(x / peak, self.packed, reduce_range).mul_(peak)
        return out if self.bias is None else out.add_(self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"engine={self.engine}, anchored={self.anchor is not None}")


@contextlib.contextmanager
def _quantized_engine(engine: str) -> Iterator[None]:
    """Within: torch's quantized engine (a process-wide setting) is `engine`; restored after."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


def _dynamic_linear(linear: nn.Linear, engine: str, anchored: bool = False, quantized=None) -> DynamicInt8Linear:
    try:
        return DynamicInt8Linear(linear, engine, anchored, quantized)
    except RuntimeError as err:  # oneDNN refused this weight: fbgemm has kernels wherever AVX2 is
        fallback = next((e for e in ("x86", "fbgemm") if e in torch.backends.quantized.supported_engines), None)
        if engine == "onednn" and fallback:
            log.warning("quant=int8: oneDNN could not pack a %d x %d weight (%s); it runs on %s",
                        linear.out_features, linear.in_features, err, fallback)
            return DynamicInt8Linear(linear, fallback, anchored, quantized)
        raise


def quantize_linears(model: nn.Module, mode: str = "int8", kernel: str = "auto", engine: str = "auto",
                     wide_copy: bool = False, batch_invariant: bool = False, dtype: torch.dtype | None = None,
                     int4_kernel: str = "auto") -> str:
    """Swap every `nn.Linear` (lm_head included) for an int8 one, in place; returns the int8 kernel used.
    With mode "int4", the decoder's linears whose input splits into groups of INT4_GROUP get 4 bits instead.
    Then nothing of the loaded weights is kept (`keep_own_copies`) and the embedding table is held once
    (`quantize_embedding`).

    kernel: "auto" (dynamic where `dynamic_int8_supported`, else weight-only), "dynamic" or "weight_only".
    engine (dynamic only): "auto" (app/models/cpu.py `int8_engine`) or a torch quantized engine by name.
    wide_copy (int4, INT4_WIDE_COPY): a bf16 copy of the 4-bit weights for calls of many rows, where the CPU
    multiplies bf16 natively.
    int4_kernel (INT4_KERNEL): ours (app/models/int4_decode.py: auto, vnni, avx2, reference) or aten's.
    batch_invariant (BATCH_INVARIANT): dynamic int8 with its anchor row (DynamicInt8Linear), and never int4's
    bf16 copy, which computes a row of a wide call otherwise than the same row alone. Whether each kernel then
    computes a row the same way at any row count is checked after (app/models/invariance.py).
    dtype: what the model runs in, where it was loaded narrower (a bf16 checkpoint served in fp32, so that loading
    peaks at the checkpoint's size, not fp32's): each linear is quantized from its loaded weights (read in fp32,
    one layer at a time), and every float left (norms, biases) is widened to `dtype` after, exactly.
    A streamed load (app/models/streamed_load.py) makes the same swaps one linear at a time, as its weights arrive,
    with the same `LinearQuantizer`, and ends with the same `finish_quantizing`.
    """
    if mode not in QUANT_MODES:
        raise ValueError(f"quant must be one of {', '.join(QUANT_MODES)}, not {mode!r}")
    if mode == "none":
        return "none"
    quantizer = LinearQuantizer(model, mode, kernel, engine, wide_copy, batch_invariant, dtype,
                                int4_kernel=int4_kernel)
    tied = tied_head(model)
    _swap_linears(model, quantizer, lambda linear: linear is not tied)
    return finish_quantizing(model, quantizer)


def tied_head(model: nn.Module) -> nn.Linear | None:
    """The lm_head where it is a plain linear that shares its weight with the input embedding table."""
    head, embed = getattr(model, "lm_head", None), model.get_input_embeddings()
    tied = isinstance(head, nn.Linear) and type(embed) is nn.Embedding and head.weight is embed.weight
    return head if tied else None


class LinearQuantizer:
    """What `quantize_linears` swaps each linear for, decided once for the model: called with a plain `nn.Linear`,
    its int4 or int8 replacement. `device`: where the weights will be (a model still on the meta device has none)."""

    def __init__(self, model: nn.Module, mode: str, kernel: str = "auto", engine: str = "auto",
                 wide_copy: bool = False, batch_invariant: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | None = None, int4_kernel: str = "auto"):
        param = next(model.parameters())
        self.dtype, device = dtype or param.dtype, device or param.device
        self.wide_copy, self.batch_invariant, self.bf16 = wide_copy, batch_invariant, cpu_features().native_bf16
        self.head = model.get_output_embeddings()  # int8 with QUANT=int4 too
        self.tied: int | None = None  # `quantize_table`'s: 1 where the lm_head's int8 rows are the table's
        if mode == "int4" and (missing := int4_kernel_missing(device)):
            log.warning("quant=int4: %s; every linear layer reads int8 weights instead", missing)
            mode = "int8"
        self.int4_kernel = choose_int4_kernel(int4_kernel) if mode == "int4" else None
        self.int4 = (functools.partial(Int4Linear, wide_bf16=bool(wide_copy and self.bf16 and not batch_invariant),
                                       kernel=self.int4_kernel) if mode == "int4" else None)
        # QUANT=int4's lm_head, the largest matmul of a step, on fbgemm's dynamic kernel where it runs: on a Zen 4
        # the weight-only kernel took 10.5 ms of a 0.5B int4 step's 32.9 (bench generate --profile); fbgemm ran the
        # same 151,936 x 896 head in 3.4-4.7 ms at one row, 6.3 against 24.7 at 8. A tied head then costs a packed
        # copy beside the table's int8 rows (the table cannot gather from a packed weight).
        head_engine = int8_engine()[0] if mode == "int4" and device.type == "cpu" and kernel == "auto" else None
        self.head_int8 = head_engine and functools.partial(_dynamic_linear, engine=head_engine,
                                                           anchored=batch_invariant)
        if kernel == "auto":
            kernel = "dynamic" if dynamic_int8_supported(device, self.dtype) else "weight_only"
        self.kernel, self.why = kernel, "weight-only"
        if kernel == "dynamic":
            chosen, self.why = int8_engine() if engine == "auto" else (engine, f"engine={engine} was asked for")
            if chosen is None:
                raise ValueError(f"dynamic int8 cannot run here: {self.why}")
            self.int8 = functools.partial(_dynamic_linear, engine=chosen, anchored=batch_invariant)
        else:
            self.int8 = functools.partial(WeightOnlyInt8Linear, dtype=self.dtype)

    def __call__(self, linear: nn.Linear) -> nn.Module:
        if self.int4 is not None and linear is not self.head and linear.in_features % INT4_GROUP == 0:
            return self.int4(linear)
        return self.leftover(linear)

    def leftover(self, linear: nn.Linear) -> nn.Module:
        """A linear swapped at the end (an untied lm_head not streamed in yet, or any other left), or one that keeps
        its GGUF bits (QUANT=auto): in int8, the lm_head on `head_int8` where there is one."""
        return self.head_int8(linear) if linear is self.head and self.head_int8 else self.int8(linear)


def finish_quantizing(model: nn.Module, quantizer: LinearQuantizer) -> str:
    """After the decoder's linears are swapped: the tied lm_head, any linear left, the embedding table, own copies
    of every float left, and the log lines; returns the int8 kernel."""
    kernel, dtype = quantizer.kernel, quantizer.dtype
    tied = quantizer.tied if quantizer.tied is not None else quantize_table(model, quantizer)
    _swap_linears(model, quantizer.leftover, lambda linear: True)  # an untied head whose weight was not swapped yet
    four_bits, eight = (sum(isinstance(m, kind) for m in model.modules()) for kind in (Int4Linear, GroupInt8Linear))
    count = sum(isinstance(m, (DynamicInt8Linear, WeightOnlyInt8Linear)) for m in model.modules())
    if quantizer.int4 is not None:
        log.info("quant=int4: %d linear layers read 4-bit weights in groups of %d (%s; %s)%s; the lm_head and any "
                 "other layer read int8%s", four_bits, INT4_GROUP, _int4_kernel_note(quantizer.int4_kernel),
                 _wide_copy_note(model, quantizer.wide_copy, quantizer.bf16, quantizer.batch_invariant),
                 f"; {eight} a GGUF's own 5- to 8-bit codes, in 8-bit groups on the same kernel" if eight else "",
                 f" (the lm_head on {model.lm_head.engine}'s dynamic kernel)"
                 if isinstance(getattr(model, "lm_head", None), DynamicInt8Linear) else "")
    if count or not (four_bits or eight):
        log.info("quant=int8: %d linear layers now read int8 weights (%s kernel: %s)%s%s", count, kernel,
                 quantizer.why, "; the tied lm_head's int8 rows are the input embedding's, held once" if tied else "",
                 ", on the weight-only kernel in bf16 (native here)" if tied and kernel == "dynamic" else "")
    keep_own_copies(model, dtype)
    return kernel


def quantize_table(model: nn.Module, quantizer: LinearQuantizer) -> int:
    """The input embedding table as int8 rows, shared with a tied lm_head where it can be (`_quantize_tied_head`);
    returns 1 where it is shared. A streamed load calls it as soon as the table has arrived."""
    head, embed = tied_head(model), model.get_input_embeddings()
    if head is not None and quantizer.head_int8:  # the table's int8 rows, packed again for the head
        codes, scales = per_row_int8(head.weight)
        model.set_input_embeddings(Int8Embedding(embed, quantizer.dtype, codes, scales))
        head.weight = embed.weight = None  # the float table goes before the packing, not after: a lower load peak
        model.lm_head, quantizer.tied, quantizer.head = quantizer.head_int8(head, quantized=(codes, scales)), 0, None
    else:  # the float head swapped out (tied): not kept as the quantizer's head
        quantizer.tied = _quantize_tied_head(model, quantizer.kernel, quantizer.dtype)
        quantizer.head = None if quantizer.tied else quantizer.head
    quantize_embedding(model, quantizer.dtype)
    return quantizer.tied


def _int4_kernel_note(kernel: Int4Kernel) -> str:
    """What the start log says of INT4_KERNEL: which kernel, and why."""
    if kernel.ours:
        return f"our int4 x int8 kernel, {kernel.why}"
    return (f"aten's int4 CPU kernel, ATen capability {torch.backends.cpu.get_cpu_capability()}, bf16 activations: "
            f"{kernel.why}")


def _wide_copy_note(model: nn.Module, asked: bool, bf16: str | None, batch_invariant: bool = False) -> str:
    """What the start log says of INT4_WIDE_COPY: what it costs where it is on, why not where it is off."""
    copies = sum(m.copy_bytes for m in model.modules() if isinstance(m, Int4Linear))
    if copies:
        return (f"INT4_WIDE_COPY: calls of more than {Int4Linear.DECODE_ROWS} rows on a bf16 copy of the same "
                f"weights ({bf16}), {copies / 2**20:,.1f} MiB more memory")
    if asked and batch_invariant:
        return ("INT4_WIDE_COPY asked for, but BATCH_INVARIANT is on: every call on the int4 kernel (the copy would "
                "compute a row of a wide call otherwise than the same row alone)")
    if asked:
        return "INT4_WIDE_COPY asked for, but no native bf16 matmul here for a copy: every call on the int4 kernel"
    return "every call on it: no bf16 copy (INT4_WIDE_COPY=false)"


def quantize_embedding(model: nn.Module, dtype: torch.dtype | None = None) -> None:
    """The input embedding table (CPU, a plain float one) as int8 rows (app/models/quant_embedding.py), whose
    gathered rows come back in `dtype` (default: the table's)."""
    embedding = model.get_input_embeddings()
    if type(embedding) is nn.Embedding and embedding.weight.device.type == "cpu":
        model.set_input_embeddings(Int8Embedding(embedding, dtype or embedding.weight.dtype))


_QUANTIZED = (Int4Linear, GroupInt8Linear, WeightOnlyInt8Linear, DynamicInt8Linear, Int8Embedding)


@torch.no_grad()
def keep_own_copies(model: nn.Module, dtype: torch.dtype | None = None) -> None:
    """Every parameter and buffer in memory of its own, so that no view of the checkpoint's mapped file outlives
    loading (the module docstring). A float loaded narrower than `dtype` (the norms and biases of a bf16 checkpoint
    served in fp32) is widened to it in the same copy, which is exact: the model then runs as if loaded in `dtype`,
    and a buffer kept in fp32 on purpose (rotary frequencies) stays as it is. A quantized layer's own buffers (int4's
    bf16 scales) are its format, new already, and left alone; its bias is the loaded one, copied like the rest."""
    def own(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.is_floating_point() and t.element_size() < dtype.itemsize:
            return t.to(dtype, copy=True)
        return t.clone()

    seen: set[int] = set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) not in seen:  # a tied parameter: once
                seen.add(id(param))
                param.data = own(param.data)
        if not isinstance(module, _QUANTIZED):
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = own(buffer)


def _swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module], wanted: Callable[[nn.Linear], bool]) -> int:
    """Replace each plain `nn.Linear` that `wanted` accepts with `make(linear)`, in place; returns how many."""
    count = 0
    with torch.no_grad():
        for parent, name, child in plain_linears(model):
            if wanted(child):
                setattr(parent, name, make(child))
                count += 1
    return count


def _quantize_tied_head(model: nn.Module, kernel: str, dtype: torch.dtype) -> int:
    """A tied lm_head (the input embedding's table, multiplied) on the weight-only kernel: int8 rows that the
    embedding then gathers, held once (app/models/quant_embedding.py); returns 1. With the dynamic kernel, whose
    packed weight cannot be gathered from, the head still takes the weight-only kernel on the shared rows, in bf16,
    where the CPU multiplies bf16 natively; elsewhere it is untied: quantized as any linear, the table apart
    (returns 0)."""
    head, embed = tied_head(model), model.get_input_embeddings()
    if head is None:
        return 0
    shares = head.weight.device.type == "cpu" and (kernel != "dynamic" or cpu_features().native_bf16 is not None)
    if not shares:
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        return 0
    codes, scales = per_row_int8(head.weight)
    model.lm_head = WeightOnlyInt8Linear(head, torch.bfloat16 if kernel == "dynamic" else dtype, (codes, scales))
    model.set_input_embeddings(Int8Embedding(embed, dtype, codes, scales))
    return 1
