"""QUANT=int8 and QUANT=int4 (app/models/quant.py): every linear reads int8 weights, with both kernels (int4: the
decoder's read 4 bits, the lm_head int8), and stays close to the unquantized model. Quantization is not exact, so
these tests measure how far it strays and bound it.

Bounds, measured on the tiny random model (whose weights, unlike the embedded models', are not on a 4-bit grid, so
this is a harder case): logits within 3% (relative L2 norm) for both kernels; greedy tokens under teacher forcing
agree at >= 90% of positions (measured 47 of 48, for each kernel). The real model's figures come from `bench quality` (docs/performance.md).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from app.config import Settings
from app.core.generate import generate
from app.core.sampling import SamplingParams
from app.models.cpu import int8_engine
from app.models.fuse import join_projections, projection_layers
from app.models.int4_decode import choose_int4_kernel
from app.models.loading import load_model, quant_auto_dtype
from app.models.prepack import decode_bytes_per_step
from app.models.quant import DynamicInt8Linear, WeightOnlyInt8Linear, dynamic_int8_supported, quantize_linears
from app.models.quant_embedding import Int8Embedding
from app.models.quant_int4 import INT4_GROUP, QUANTIZE_ROWS, Int4Linear, int4_kernel_missing, int4_weight
from app.models.weight_memory import weight_bytes_by_format

from conftest import build_tiny_model

PROMPTS = ["Which city is the capital of France?", "北京是中国的首都。请介绍一下北京。", "def reverse(s):"]
KERNELS = ["weight_only"] + (["dynamic"] if dynamic_int8_supported(torch.device("cpu"), torch.float32) else [])
LINEARS_IN_TINY = 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and lm_head
INT4 = pytest.mark.skipif(int4_kernel_missing(torch.device("cpu")) is not None, reason="no int4 CPU kernel in this torch")


def greedy(model, tokenizer, ids, n=16):
    params = SamplingParams(max_tokens=n, do_sample=False, ignore_eos=True)
    return [e.token_id for e in generate(model, tokenizer, ids, params, (), 256)]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def plain(tiny_tokenizer):
    return build_tiny_model(len(tiny_tokenizer))


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_linear_is_int8_and_logits_stay_close(plain, tiny_tokenizer, kernel):
    quantized = copy.deepcopy(plain)
    assert quantize_linears(quantized, "int8", kernel) == kernel
    kinds = [type(m) for m in quantized.modules()]
    wanted = DynamicInt8Linear if kernel == "dynamic" else WeightOnlyInt8Linear
    assert kinds.count(nn.Linear) == 0 and kinds.count(wanted) == LINEARS_IN_TINY
    for text in PROMPTS:
        ids = torch.tensor([tiny_tokenizer.encode(text)])
        with torch.inference_mode():
            assert relative_error(quantized(ids).logits, plain(ids).logits) < 0.03


@pytest.mark.full
@pytest.mark.parametrize("kernel", KERNELS)
def test_greedy_agreement_with_the_unquantized_model(plain, tiny_tokenizer, kernel):
    quantized = copy.deepcopy(plain)
    quantize_linears(quantized, "int8", kernel)
    agree = total = 0
    for text in PROMPTS:
        ids = tiny_tokenizer.encode(text)
        reference = greedy(plain, tiny_tokenizer, ids)
        with torch.inference_mode():  # teacher forcing: the int8 model's top token after the reference's prefix
            logits = quantized(torch.tensor([ids + reference])).logits[0, len(ids) - 1:-1]
        agree += int((logits.argmax(-1) == torch.tensor(reference)).sum())
        total += len(reference)
    print(f"{kernel}: top-1 agreement {agree}/{total}")
    assert agree / total >= 0.9
    assert len(greedy(quantized, tiny_tokenizer, ids)) == 16  # and the decode loop runs on it


def test_weight_only_int8_runs_bf16_activations(plain, tiny_tokenizer):
    """The fallback for CUDA and CPUs without fbgemm keeps bf16 activations and bf16 outputs."""
    bf16 = copy.deepcopy(plain).to(torch.bfloat16)
    quantized = copy.deepcopy(bf16)
    assert quantize_linears(quantized, "int8") == "weight_only"  # auto: bf16 activations -> weight-only
    ids = torch.tensor([tiny_tokenizer.encode(PROMPTS[0])])
    with torch.inference_mode():
        out = quantized(ids).logits
    assert out.dtype == torch.bfloat16 and relative_error(out, bf16(ids).logits) < 0.05


def _tied_model(tokenizer):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


TIED_CASES = [("weight_only", None)] + [("dynamic", c) for c in ("ZEN4", "ZEN3") if "dynamic" in KERNELS]


@pytest.mark.parametrize("kernel, cpu_class", TIED_CASES)
def test_a_tied_lm_head_and_its_embedding_table_hold_the_table_once_where_the_kernel_can_share(
        tiny_tokenizer, monkeypatch, kernel, cpu_class):
    """The table is held as int8 rows with a scale each: the embedding gathers them, and a gathered row comes back
    in fp32 within half a step of its row's grid. A tied lm_head on the weight-only kernel multiplies the same rows,
    held once: where the kernel is weight-only anyway, and under fp32's dynamic kernel on a CPU with native bf16
    (a Zen 4), whose head then runs weight-only in bf16 and gives fp32 logits. Without native bf16 (a Zen 3), where
    the weight-only kernel has no fast path, the dynamic head holds its own rows (fbgemm's packed weight cannot be
    gathered from)."""
    if cpu_class:
        as_cpu_class(monkeypatch, cpu_class)
    model = _tied_model(tiny_tokenizer)
    plain = copy.deepcopy(model)
    table = model.get_input_embeddings().weight.detach().clone()
    quantize_linears(model, "int8", kernel)
    embedding, head = model.get_input_embeddings(), model.lm_head
    assert isinstance(embedding, Int8Embedding)
    ids = torch.tensor([[1, 5, 9]])
    rows = embedding(ids)
    step = table.abs().amax(dim=1, keepdim=True) / 127
    assert rows.dtype == torch.float32 and bool(((rows - table[ids]).abs() <= step[ids] / 2 + 1e-7).all())
    assert model.dtype == torch.float32  # the model still runs in fp32: its first float parameter is a norm's
    vocab, dim = table.shape
    held = weight_bytes_by_format(model)
    assert held["embeddings"] == vocab * dim + 4 * vocab  # int8 and a scale per row
    body = sum(m.weight_bytes for name, m in model.named_modules() if name.startswith("model.layers.")
               and hasattr(m, "weight_bytes"))
    if cpu_class != "ZEN3":
        assert isinstance(head, WeightOnlyInt8Linear)
        assert head.scales.dtype == (torch.bfloat16 if kernel == "dynamic" else torch.float32)
        assert head.weight_int8.data_ptr() == embedding.codes.data_ptr()  # the same memory, not a copy
        scales = vocab * 2 if kernel == "dynamic" else 0  # the bf16 head's own bf16 copy of the rows' scales
        assert held["int8"] == body + scales  # the head's rows counted once, with the embeddings
    else:
        assert isinstance(head, DynamicInt8Linear)
        assert held["int8"] == body + head.weight_bytes >= body + vocab * dim  # a second set of rows
    with torch.inference_mode():
        logits = model(ids).logits
        assert logits.dtype == torch.float32 and relative_error(logits, plain(ids).logits) < 0.03


def test_bytes_per_step_count_int8_weights(plain):
    quantized = copy.deepcopy(plain)
    before = decode_bytes_per_step(plain)
    quantize_linears(quantized, "int8", "weight_only")
    after = decode_bytes_per_step(quantized)
    assert 0.25 * before < after < 0.3 * before  # int8 + one fp32 scale per row, against fp32 weights


def test_load_model_quantizes_and_the_setting_is_validated(tmp_path, tiny_tokenizer, monkeypatch):
    build_tiny_model(len(tiny_tokenizer)).save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), "cpu", "auto", quant="int8")
    kinds = {type(m) for m in lm.model.modules()}
    assert nn.Linear not in kinds and kinds & {DynamicInt8Linear, WeightOnlyInt8Linear}
    if KERNELS[-1] == "dynamic":
        assert lm.dtype == torch.float32  # dtype=auto + int8 picks fp32 activations for the dynamic kernel
    monkeypatch.setenv("QUANT", "int8")
    assert Settings().quant == "int8"
    monkeypatch.setenv("QUANT", "int3")
    with pytest.raises(ValueError, match="quant"):
        Settings()
    with pytest.raises(ValueError, match="quant must be one of"):
        quantize_linears(copy.deepcopy(lm.model), "int3")


def test_dynamic_int8_quantizes_each_row_on_its_own_scale():
    """A token with huge activations (the first token's, in an MLP) must not cost the others their precision:
    each row of a call comes out as close to fp32 as when it runs alone, and a bias still applies."""
    torch.manual_seed(0)
    torch.backends.quantized.engine = "x86" if "x86" in torch.backends.quantized.supported_engines else "fbgemm"
    linear = torch.nn.Linear(256, 64)
    layer = DynamicInt8Linear(linear)
    rows = torch.randn(16, 256)
    rows[0] *= 50  # the outlier
    exact = linear(rows).detach()
    together = layer(rows)
    alone = torch.cat([layer(row[None]) for row in rows])
    relative = lambda got: ((got - exact)[1:].norm() / exact[1:].norm()).item()  # noqa: E731
    assert relative(together) < 0.02 and relative(alone) < 0.02
    assert ((together - alone)[1:].norm() / exact[1:].norm()).item() < 0.02


@pytest.mark.skipif("dynamic" not in KERNELS, reason="no dynamic int8 engine on this CPU")
@pytest.mark.parametrize("engine", [e for e in ("x86", "onednn") if e in torch.backends.quantized.supported_engines])
def test_each_dynamic_engine_keeps_the_logits_close(plain, tiny_tokenizer, engine):
    """oneDNN is what an AMX CPU gets (its AMX-INT8 kernels cannot run here, but its VNNI/AVX2 ones do, with the same
    packing and numerics); x86 (fbgemm) is what every other x86 CPU gets."""
    quantized = copy.deepcopy(plain)
    quantize_linears(quantized, "int8", "dynamic", engine=engine)
    assert {m.engine for m in quantized.modules() if isinstance(m, DynamicInt8Linear)} == {engine}
    ids = torch.tensor([tiny_tokenizer.encode(PROMPTS[0])])
    with torch.inference_mode():
        assert relative_error(quantized(ids).logits, plain(ids).logits) < 0.03
        assert relative_error(quantized(ids[:, :1]).logits, plain(ids[:, :1]).logits) < 0.03  # one decode row


@pytest.mark.skipif("x86" not in torch.backends.quantized.supported_engines,
                    reason="this torch has no fbgemm to fall back on")
def test_a_weight_onednn_refuses_runs_on_fbgemm(plain, monkeypatch, caplog):
    from app.models import quant

    real_prepack = torch.ops.quantized.linear_prepack

    def onednn_refuses(qweight, bias):
        if torch.backends.quantized.engine == "onednn":
            raise RuntimeError("onednn: unsupported weight")
        return real_prepack(qweight, bias)

    monkeypatch.setattr(quant.torch.ops.quantized, "linear_prepack", onednn_refuses)
    linear = nn.Linear(64, 32)
    layer = quant._dynamic_linear(linear, "onednn")
    assert layer.engine == "x86" and "oneDNN could not pack a 32 x 64 weight" in caplog.text
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert relative_error(layer(x), linear(x)) < 0.03



@INT4
def test_int4_decoder_linears_read_4_bits_and_logits_stay_close(plain, tiny_tokenizer, caplog):
    """The tiny model's random weights are not on a 4-bit grid, so every weight is rounded: the bound is wider than
    int8's. Measured on Zen 3 (AVX2): 7.8% to 10.8% relative error on the three prompts' logits, 10.0% to 13.9% on
    their first token alone; under teacher forcing 42 of 48 greedy tokens agree with the unquantized model's."""
    quantized = copy.deepcopy(plain)
    with caplog.at_level("INFO", logger="app.models.quant"):
        quantize_linears(quantized, "int4")
    kinds = [type(m) for m in quantized.modules()]
    assert kinds.count(Int4Linear) == LINEARS_IN_TINY - 1 and nn.Linear not in kinds
    assert not isinstance(quantized.lm_head, Int4Linear)  # int8: faster than torch's int4 kernel on the lm_head
    assert f"14 linear layers read 4-bit weights in groups of {INT4_GROUP}" in caplog.text
    kernel = choose_int4_kernel("auto")  # ours where it builds and runs here (tests/fast/test_int4_kernel.py)
    assert (f"our int4 x int8 kernel, {kernel.why}" if kernel.ours else
            f"aten's int4 CPU kernel, ATen capability {torch.backends.cpu.get_cpu_capability()}") in caplog.text
    for text in PROMPTS:
        ids = torch.tensor([tiny_tokenizer.encode(text)])
        with torch.inference_mode():
            assert relative_error(quantized(ids).logits, plain(ids).logits) < 0.2
            assert relative_error(quantized(ids[:, :1]).logits, plain(ids[:, :1]).logits) < 0.2  # one decode row
    agree = total = 0
    for text in PROMPTS:
        ids = tiny_tokenizer.encode(text)
        reference = greedy(plain, tiny_tokenizer, ids)
        with torch.inference_mode():  # teacher forcing, as for int8
            logits = quantized(torch.tensor([ids + reference])).logits[0, len(ids) - 1:-1]
        agree += int((logits.argmax(-1) == torch.tensor(reference)).sum())
        total += len(reference)
    assert agree / total >= 0.8
    assert len(greedy(quantized, tiny_tokenizer, ids)) == 16  # and the decode loop runs on it


@INT4
def test_int4_on_a_q4k_grid_keeps_its_codes():
    """A Q4_K sub-block is 32 weights, each d * scale * q - dmin * min with q in 0..15: re-quantizing such
    dequantized weights in groups of 32 finds the same codes, and Int4Linear multiplies with them up to the bf16
    rounding of each group's scale and zero."""
    torch.manual_seed(0)
    out_f, in_f = 48, 4 * INT4_GROUP
    codes = torch.randint(0, 16, (out_f, in_f))
    codes[:, ::INT4_GROUP], codes[:, 1::INT4_GROUP] = 0, 15  # a Q4_K block's scale and minimum span its codes
    scale = torch.rand(out_f, in_f // INT4_GROUP, 1) * 0.01 + 1e-3
    minimum = torch.rand(out_f, in_f // INT4_GROUP, 1) * 0.05
    weight = (codes.reshape(out_f, -1, INT4_GROUP) * scale - minimum).reshape(out_f, in_f)
    found, _, dequantized = int4_weight(weight, INT4_GROUP, dequantize=True)
    assert torch.equal(found, codes.to(torch.int32))
    assert relative_error(dequantized, weight) < 1e-6
    linear = nn.Linear(in_f, out_f, bias=False)
    linear.weight.data.copy_(weight)
    x = torch.randn(5, in_f)
    with torch.inference_mode():
        assert relative_error(Int4Linear(linear)(x), linear(x)) < 0.02  # bf16 activations, scales and zeros


@INT4
def test_a_weight_quantized_a_few_rows_at_a_time_gets_the_codes_of_the_whole_at_once():
    """int4_weight takes QUANTIZE_ROWS rows at a time (a lower load peak): the same codes, scales and zeros as the
    whole weight in one go, across a last chunk that is not full."""
    weight = torch.randn(2 * QUANTIZE_ROWS + 37, 3 * INT4_GROUP).bfloat16()
    codes, scales_and_zeros, dequantized = int4_weight(weight, INT4_GROUP, dequantize=True)
    groups = weight.float().reshape(weight.shape[0], -1, INT4_GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-12)
    whole = torch.round((groups - low) / scale).clamp(0, 15)
    assert torch.equal(codes, whole.to(torch.int32).reshape(weight.shape))
    assert torch.equal(scales_and_zeros[..., 0], scale.squeeze(-1).t())
    assert torch.equal(scales_and_zeros[..., 1], (low + 8 * scale).squeeze(-1).t())
    assert torch.equal(dequantized, (whole * scale + low).reshape(weight.shape))
    assert int4_weight(weight, INT4_GROUP)[2] is None


def test_int4_wide_calls_multiply_the_same_4_bit_weights_in_bf16():
    """A call of more than DECODE_ROWS rows (a prefill chunk) multiplies a bf16 copy of the dequantized 4-bit
    weights instead of running the int4 kernel: each row's result is the one the kernel gives that row, up to the
    order in which bf16 products are summed."""
    torch.manual_seed(0)
    linear = nn.Linear(4 * INT4_GROUP, 48, bias=True)
    both, kernel_only = Int4Linear(linear, wide_bf16=True), Int4Linear(linear)
    assert kernel_only.wide is None and both.wide.dtype == torch.bfloat16
    x = torch.randn(3 * Int4Linear.DECODE_ROWS, 4 * INT4_GROUP)
    with torch.inference_mode():
        wide = both(x)
        one_row_at_a_time = torch.cat([both(row[None]) for row in x])  # each a decode call: the int4 kernel
        assert torch.equal(one_row_at_a_time, torch.cat([kernel_only(row[None]) for row in x]))
        assert relative_error(wide, one_row_at_a_time) < 0.01
        assert relative_error(wide, linear(x)) > 10 * relative_error(wide, one_row_at_a_time)  # the 4-bit layer


def as_cpu_class(monkeypatch, cpu_class: str):
    """Decide as a CPU with this class's /proc/cpuinfo flags would (tests/cpu_flags.py)."""
    import cpu_flags
    from app.models import cpu, quant, quant_int4

    features = cpu.features_from_cpuinfo(getattr(cpu_flags, f"{cpu_class}_FLAGS"), cpu_class)
    monkeypatch.setattr(quant, "cpu_features", lambda: features)
    monkeypatch.setattr(quant_int4, "cpu_features", lambda: features)
    monkeypatch.setattr(quant, "int8_engine", lambda: cpu.int8_engine(features))
    return features


@pytest.mark.parametrize("wide_copy", [False, True])
@pytest.mark.parametrize("cpu_class", ["SAPPHIRE_RAPIDS", "ZEN3"])
@INT4
def test_int4_wide_calls_on_bf16_only_when_asked_and_where_the_cpu_multiplies_bf16_natively(
        plain, monkeypatch, caplog, cpu_class, wide_copy):
    as_cpu_class(monkeypatch, cpu_class)
    quantized = copy.deepcopy(plain)
    with caplog.at_level("INFO", logger="app.models.quant"):
        quantize_linears(quantized, "int4", wide_copy=wide_copy)
    wide = {m.wide is not None for m in quantized.modules() if isinstance(m, Int4Linear)}
    copies = weight_bytes_by_format(quantized)["copies"]
    if cpu_class == "SAPPHIRE_RAPIDS" and wide_copy:  # AVX512_BF16 and AMX-BF16
        assert wide == {True} and copies == sum(2 * m.in_features * m.out_features
                                                for m in quantized.modules() if isinstance(m, Int4Linear))
        assert (f"INT4_WIDE_COPY: calls of more than 4 rows on a bf16 copy of the same weights (AVX512_BF16 and "
                f"AMX-BF16), {copies / 2**20:,.1f} MiB more memory") in caplog.text
    else:
        assert wide == {False} and copies == 0
        assert ("no native bf16 matmul here for a copy" if wide_copy else "no bf16 copy (INT4_WIDE_COPY=false)") \
            in caplog.text


@pytest.mark.parametrize("cpu_class", ["SAPPHIRE_RAPIDS", "ZEN4", "ZEN3"])
@INT4
def test_quantized_linears_hold_a_fraction_of_bf16s_bytes_on_every_cpu_class(plain, monkeypatch, cpu_class):
    """What the memory goal rests on, as each CPU class would choose (its int8 engine, whether int4 may keep a
    copy): the quantized linears' bytes, copies included, against the same linears in bf16. int4: 4 bits and a bf16
    scale and zero per 32 weights, 0.3125x (the lm_head's int8 apart); int8: 1 byte and an fp32 scale per row."""
    as_cpu_class(monkeypatch, cpu_class)
    bf16_bytes = {name: 2 * m.weight.numel() for name, m in plain.named_modules() if isinstance(m, nn.Linear)}
    for mode, bound in (("int4", 0.35), ("int8", 0.55)):
        quantized = copy.deepcopy(plain)
        quantize_linears(quantized, mode)
        layers = {name: m for name, m in quantized.named_modules() if name in bf16_bytes}
        by_kind = {Int4Linear: 0, DynamicInt8Linear: 0, WeightOnlyInt8Linear: 0}
        for name, m in layers.items():
            by_kind[type(m)] += m.weight_bytes + getattr(m, "copy_bytes", 0)
        if mode == "int4":
            four_bit = sum(bf16_bytes[n] for n, m in layers.items() if isinstance(m, Int4Linear))
            assert by_kind[Int4Linear] <= bound * four_bit
        else:
            assert sum(by_kind.values()) <= bound * sum(bf16_bytes.values())
        held = weight_bytes_by_format(quantized)
        assert held["copies"] == 0 and held["fp32"] == held["bf16"] == 0  # no float linear, no copy
        table = 2 * plain.get_input_embeddings().weight.numel()  # in bf16
        assert held["embeddings"] <= 0.55 * table  # int8 rows and a scale each
        assert isinstance(quantized.get_input_embeddings(), Int8Embedding)


@pytest.mark.full
@INT4
def test_load_model_keeps_nothing_of_the_loaded_file(tiny_dir):
    """transformers maps the checkpoint and hands out views of it; a view left after quantizing kept the whole file
    mapped, and every page quantizing read counted in the server's RSS (2,128 MiB of the 0.5B model's fp32 file)."""
    import gc

    for quant in ("int8", "int4"):
        lm = load_model(str(tiny_dir), "cpu", "auto", quant=quant)
        gc.collect()
        maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").is_file() else ""
        assert str(tiny_dir / "model.safetensors") not in maps, f"QUANT={quant}: the checkpoint is still mapped"
        assert lm.weight_bytes["fp32"] == lm.weight_bytes["bf16"] == 0 and lm.weight_bytes[quant] > 0
        del lm


@INT4
def test_int4_holds_fewer_bytes_than_int8(plain):
    int8, int4 = copy.deepcopy(plain), copy.deepcopy(plain)
    quantize_linears(int8, "int8", "weight_only")
    quantize_linears(int4, "int4", "weight_only")
    decoder = [m for m in int4.modules() if isinstance(m, Int4Linear)]
    assert sum(m.weight_bytes for m in decoder) < 0.7 * sum(m.in_features * m.out_features for m in decoder)
    assert decode_bytes_per_step(int4) < decode_bytes_per_step(int8)


def test_int4_without_its_kernel_falls_back_to_int8_and_says_so(plain, monkeypatch, caplog):
    from app.models import quant

    monkeypatch.setattr(quant, "int4_kernel_missing", lambda device: "no int4 kernel on this test's device")
    quantized = copy.deepcopy(plain)
    assert quantize_linears(quantized, "int4", "weight_only") == "weight_only"
    assert [type(m) for m in quantized.modules()].count(WeightOnlyInt8Linear) == LINEARS_IN_TINY
    assert "quant=int4: no int4 kernel on this test's device; every linear layer reads int8 weights" in caplog.text


@INT4
def test_load_model_with_quant_int4(tmp_path, tiny_tokenizer, monkeypatch):
    build_tiny_model(len(tiny_tokenizer)).save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), "cpu", "auto", quant="int4")
    assert [type(m) for m in projection_layers(lm.model)].count(Int4Linear) == LINEARS_IN_TINY - 1
    monkeypatch.setenv("QUANT", "int4")
    assert Settings().quant == "int4" and Settings().int4_wide_copy is False  # the bf16 copy: opt-in
    monkeypatch.setenv("INT4_WIDE_COPY", "true")
    assert Settings().int4_wide_copy is True
    assert lm.weight_bytes["copies"] == 0 and lm.weight_bytes["int4"] > 0


@pytest.mark.parametrize("quant", ["int8"] + (["int4"] if int4_kernel_missing(torch.device("cpu")) is None else []))
def test_a_bf16_checkpoint_loads_in_bf16_and_serves_the_same_model_as_an_fp32_load(tmp_path, tiny_tokenizer, quant,
                                                                                    caplog):
    """With QUANT, a bf16 checkpoint served in fp32 loads in bf16, so loading peaks at the file's size (15 GB for a
    7B model, not fp32's 30), and the model it serves is the one an fp32 load gives, bit for bit."""
    from transformers import AutoModelForCausalLM

    build_tiny_model(len(tiny_tokenizer)).to(torch.bfloat16).save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    caplog.set_level("INFO")
    # fp32 asked for: where the CPU has native bf16, QUANT=int4's `auto` is bf16 (test below)
    lm = load_model(str(tmp_path), "cpu", "float32", quant=quant, batch_invariant="off")
    assert f"loading in bfloat16, the checkpoint's dtype: QUANT={quant}" in caplog.text
    want = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    quantize_linears(want, quant, dtype=torch.float32)
    join_projections(want)  # as the load does (app/models/fuse.py): the same layers, joined alike
    assert lm.model.dtype == torch.float32
    got_state, want_state = lm.model.state_dict(), want.state_dict()
    assert got_state.keys() == want_state.keys()
    for name, tensor in want_state.items():
        assert got_state[name].dtype == tensor.dtype and torch.equal(got_state[name], tensor), name
    for text in PROMPTS:
        ids = torch.tensor([tiny_tokenizer.encode(text)])
        with torch.inference_mode():
            assert torch.equal(lm.model(ids).logits, want(ids).logits), text
        assert greedy(lm.model, tiny_tokenizer, ids[0].tolist()) == greedy(want, tiny_tokenizer, ids[0].tolist())


@pytest.mark.parametrize("cpu_class, int4_dtype", [("SAPPHIRE_RAPIDS", torch.bfloat16), ("ZEN4", torch.bfloat16),
                                                   ("ZEN5", torch.bfloat16), ("ZEN3", torch.float32)])
def test_dtype_auto_with_quant_follows_the_cpu_class(cpu_class, int4_dtype):
    """QUANT=int8 runs fbgemm's dynamic kernels, in fp32; QUANT=int4 runs in bf16 where the CPU has native bf16 (its
    4-bit kernel's own activations; the lm_head then weight-only int8), else in fp32 for its int8 lm_head."""
    import cpu_flags
    from app.models.cpu import features_from_cpuinfo

    features = features_from_cpuinfo(getattr(cpu_flags, f"{cpu_class}_FLAGS"), cpu_class)
    cpu = torch.device("cpu")
    if not dynamic_int8_supported(cpu, torch.float32):  # no fbgemm here: QUANT leaves dtype=auto as it is
        assert all(quant_auto_dtype(q, cpu, features) is None for q in ("none", "int8", "int4"))
        return
    assert quant_auto_dtype("int4", cpu, features)[0] == int4_dtype
    assert quant_auto_dtype("int8", cpu, features)[0] == torch.float32
    assert quant_auto_dtype("none", cpu, features) is None
    assert "QUANT=int4" in quant_auto_dtype("int4", cpu, features)[1]


@INT4
@pytest.mark.skipif(int8_engine()[0] is None, reason="no dynamic int8 kernel: the tied head takes the weight-only one")
def test_a_tied_head_is_packed_from_the_tables_int8_rows_after_the_float_table_is_gone(tiny_tokenizer):
    """QUANT=int4's head on the dynamic int8 kernel, tied to the table: the float table is freed before the head's
    packed copy is made (the load's peak; the 0.5B's VmHWM went from 1,184 to 1,062 MiB here), and the table
    gathers the same int8 rows the head was packed from."""
    import weakref

    from app.models.quant import LinearQuantizer, quantize_table, tied_head
    from app.models.quant_embedding import per_row_int8

    model = _tied_model(tiny_tokenizer)
    plain = copy.deepcopy(model)
    quantizer = LinearQuantizer(model, "int4")
    assert tied_head(model) is not None and quantizer.head_int8
    table = weakref.ref(model.get_input_embeddings().weight)
    alive_when_packed = []
    packer = quantizer.head_int8
    quantizer.head_int8 = lambda head, **kw: alive_when_packed.append(table() is not None) or packer(head, **kw)
    quantize_table(model, quantizer)
    assert alive_when_packed == [False]
    codes, scales = per_row_int8(plain.get_input_embeddings().weight)
    assert torch.equal(model.get_input_embeddings().codes, codes)


@INT4
def test_quant_int4_loads_in_this_cpus_dtype_with_its_head_on_the_fastest_int8_kernel(tiny_dir):
    """The lm_head on fbgemm's (or oneDNN's) dynamic int8 kernel wherever one runs, in bf16 too: the weight-only
    kernel took a third of a 0.5B int4 decode step on a Zen 4. Its logits come out in fp32, as the engine reads
    them, and stay close to the weight-only head's."""
    lm = load_model(str(tiny_dir), "cpu", "auto", quant="int4")
    expected = quant_auto_dtype("int4", torch.device("cpu"))
    assert expected is None or (lm.dtype, lm.dtype_reason) == expected
    dynamic = int8_engine()[0] is not None
    assert isinstance(lm.model.lm_head, DynamicInt8Linear if dynamic else WeightOnlyInt8Linear)
    ids = torch.tensor([[1, 5, 9, 12]])
    with torch.inference_mode():
        logits = lm.model(ids).logits
        assert logits.dtype == (torch.float32 if dynamic else lm.dtype)
        if dynamic:  # the same weights' int8 rows on the weight-only kernel, for comparison
            lm.model.lm_head = WeightOnlyInt8Linear(load_model(str(tiny_dir), "cpu", "float32").model.lm_head,
                                                    lm.dtype)
            weight_only = lm.model(ids).logits.float()
            assert (logits - weight_only).abs().max() <= 0.05 * weight_only.abs().max()
