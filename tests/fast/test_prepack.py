"""Prepacked bf16 linears on CPU (app/prepack.py): faster, and the same tokens, bit for bit, as transformers'
own model. Also the bench that reports it, run end to end on a tiny model saved to disk.

Tests that pack need a CPU that can run oneDNN's bf16 reorder (`needs_prepack`); the fallbacks (a reorder that
raises, a CPU that cannot, PREPACK=false) run on every machine. `make test` runs this file again with AVX2 forced."""

from __future__ import annotations

import argparse
import copy
import json
import logging

import pytest
import torch
from torch import nn

from benchmarks import generate as bench_generate
from app.config import Settings
from app.core.generate import generate
from app.models.loading import load_model
from app.errors import ConfigError
from app.models.prepack import PackedLinear, PrepackFailed, decode_bytes_per_step, prepack_linears, prepack_supported
from app.core.sampling import SamplingParams

from conftest import MODEL_CACHE, build_tiny_model

CAN_PREPACK = prepack_supported(torch.device("cpu"), torch.bfloat16)
needs_prepack = pytest.mark.skipif(not CAN_PREPACK, reason="this CPU cannot run oneDNN's bf16 reorder (or AVX2 is "
                                   "forced); the plain-layer tests below run instead")
PROMPTS = ["Which city is the capital of France?", "北京是中国的首都。请介绍一下北京。", "def reverse(s):"]


def linears(model) -> tuple[int, int]:
    kinds = [type(m) for m in model.modules()]
    return kinds.count(nn.Linear), kinds.count(PackedLinear)


def greedy(lm_model, tokenizer, ids, eos_ids, n=24, ignore_eos=True):
    params = SamplingParams(max_tokens=n, do_sample=False, ignore_eos=ignore_eos)
    return [e.token_id for e in generate(lm_model, tokenizer, ids, params, eos_ids, 256)]


@pytest.fixture(scope="module")
def tiny_pair(tiny_tokenizer):
    plain = build_tiny_model(len(tiny_tokenizer)).to(torch.bfloat16)
    packed = copy.deepcopy(plain)
    assert prepack_linears(packed) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and lm_head
    return plain, packed


@needs_prepack
def test_every_linear_is_packed_and_logits_are_bit_identical(tiny_pair, tiny_tokenizer):
    plain, packed = tiny_pair
    assert linears(plain) == (15, 0) and linears(packed) == (0, 15)
    for text in PROMPTS:
        ids = torch.tensor([tiny_tokenizer.encode(text)])
        with torch.inference_mode():
            assert torch.equal(plain(ids).logits, packed(ids).logits)


@needs_prepack
def test_greedy_tokens_identical_to_the_plain_model(tiny_pair, tiny_tokenizer):
    plain, packed = tiny_pair
    eos = (tiny_tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    for text in PROMPTS:
        ids = tiny_tokenizer.encode(text)
        assert greedy(packed, tiny_tokenizer, ids, eos) == greedy(plain, tiny_tokenizer, ids, eos)


@needs_prepack
def test_a_layer_that_would_change_results_stays_plain(tiny_tokenizer, monkeypatch, caplog):
    model = build_tiny_model(len(tiny_tokenizer)).to(torch.bfloat16)
    forward = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: forward(self, x) + 1)  # a wrong kernel
    with caplog.at_level(logging.WARNING, logger="app.models.prepack"):
        assert prepack_linears(model) == 0
    assert linears(model) == (15, 0)
    assert "15 linear layers gave results further from nn.Linear's than rounding explains" in caplog.text


@needs_prepack
def test_a_layer_that_only_rounds_differently_is_packed_and_counted(tiny_tokenizer, monkeypatch, caplog):
    """What an AMX CPU showed as "4 linear layers gave different results": plain calls there run another oneDNN
    kernel, whose fp32 sums, added in another order, round to the neighbouring bf16 value now and then. Simulated
    by moving every output one bf16 step: packed, counted, and the model's logits within bf16's rounding."""
    model = build_tiny_model(len(tiny_tokenizer)).to(torch.bfloat16)
    plain = copy.deepcopy(model)
    forward = PackedLinear.forward

    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: _bf16_step(forward(self, x)))
    with caplog.at_level(logging.INFO, logger="app.models.prepack"):
        assert prepack_linears(model) == 15
    assert "15 packed layers round differently from nn.Linear" in caplog.text and "further" not in caplog.text
    ids = torch.tensor([tiny_tokenizer.encode(PROMPTS[0])])
    with torch.inference_mode():
        want, got = plain(ids).logits.float(), model(ids).logits.float()
    assert not torch.equal(want, got) and ((got - want).norm() / want.norm()).item() < 0.05


def _bf16_step(out: torch.Tensor) -> torch.Tensor:
    """Each bf16 value moved to its upper neighbour (one unit in the last place)."""
    bits = out.contiguous().view(torch.int16)
    return (bits + torch.where(out >= 0, 1, -1).to(torch.int16)).view(torch.bfloat16)


def fake_timings(model, speedup_of):
    """measure_packing's answer, with a chosen speed-up per shape (no timing at all)."""
    from app.models.prepack import PackTiming

    shapes = {(m.in_features, m.out_features) for m in model.modules() if type(m) is nn.Linear}
    return [PackTiming(n_in, n_out, (1, 128), (1.0, 10.0), (1 / speedup_of(n_in, n_out), 10 / speedup_of(n_in, n_out)))
            for n_in, n_out in sorted(shapes)]


@needs_prepack
def test_auto_packs_only_the_shapes_where_packed_measured_faster(tiny_dir, monkeypatch, tmp_path):
    """As on an AMX Xeon, where plain bf16 matmuls already run on AMX and packing made the model slower. Each load
    keeps its choice in a model cache of its own: a choice kept by an earlier load (another test's, in the shared
    cache, on a CPU where prepacking runs) would be used instead of measuring."""
    import app.models.loading as loading

    slower_when_wide = lambda n_in, n_out: 0.8 if n_out > n_in else 1.5  # noqa: E731
    monkeypatch.setattr(loading, "measure_packing", lambda model: fake_timings(model, slower_when_wide))
    lm = load_model(str(tiny_dir), "cpu", "bfloat16", cache_dir=tmp_path / "first")
    for m in lm.model.modules():
        if isinstance(m, (nn.Linear, PackedLinear)):
            assert isinstance(m, PackedLinear) == (m.out_features <= m.in_features), m
    packed = linears(lm.model)[1]
    assert 0 < packed < 15 and lm.prepack.startswith(f"on: {packed} linear layers, the shapes where packed measured")
    assert "0.80x" in lm.prepack and "1.50x" in lm.prepack and "ms at 128" in lm.prepack  # the figures, in /ready

    monkeypatch.setattr(loading, "measure_packing", lambda model: fake_timings(model, lambda *_: 1.02))  # a tie
    tie = load_model(str(tiny_dir), "cpu", "bfloat16", cache_dir=tmp_path / "second")
    assert linears(tie.model) == (15, 0) and tie.prepack.startswith("off: plain measured faster on every shape (")

    def never(model):
        raise AssertionError("PREPACK=true and false must not measure")

    monkeypatch.setattr(loading, "measure_packing", never)
    assert linears(load_model(str(tiny_dir), "cpu", "bfloat16", prepack="true").model) == (0, 15)
    assert linears(load_model(str(tiny_dir), "cpu", "bfloat16", prepack="false").model) == (15, 0)


@needs_prepack
def test_the_measurement_times_every_shape_at_a_decode_row_and_a_prefill_chunk(tiny_tokenizer):
    from app.models.prepack import measure_packing

    model = build_tiny_model(len(tiny_tokenizer)).to(torch.bfloat16)
    timings = measure_packing(model, reps=2)
    shapes = {(m.in_features, m.out_features) for m in model.modules() if type(m) is nn.Linear}
    assert {(t.in_features, t.out_features) for t in timings} == shapes
    head = model.get_output_embeddings()
    for t in timings:
        is_head = (t.in_features, t.out_features) == (head.in_features, head.out_features)
        assert t.rows == ((1, 8) if is_head else (1, 128))
        assert all(ms > 0 for ms in t.plain_ms + t.packed_ms) and t.speedup > 0
    assert linears(model) == (15, 0)  # measuring swaps nothing


def test_bytes_per_decode_step_skip_the_embedding_table_and_count_a_tied_head_once(tiny_tokenizer):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    head = config.vocab_size * 64 * 2
    per_layer = (64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3 + 2 * 64) * 2  # q, o; k, v; gate, up, down; two norms
    expected = 2 * per_layer + 64 * 2 + head  # + final norm + lm_head (the embedding table itself is skipped)
    assert decode_bytes_per_step(model) == expected
    prepack_linears(model)
    assert decode_bytes_per_step(model) == expected  # the same bytes, now in oneDNN's layout


def test_load_model_prepacks_where_it_runs_unless_turned_off(tiny_dir):
    auto = load_model(str(tiny_dir), "cpu", "bfloat16")
    if CAN_PREPACK:  # packed where it measured faster (faked in the test above): the figures say which
        packed = linears(auto.model)[1]
        assert linears(auto.model) == (15 - packed, packed) and "plain/packed" in auto.prepack
        assert auto.prepack.startswith(f"on: {packed} linear layers" if packed else "off: plain measured faster")
    else:  # an AVX2-only CPU (or AVX2 forced): plain layers, and the reason, instead of a crash
        assert linears(auto.model) == (15, 0) and "oneDNN's bf16 reorder needs" in auto.prepack
    off = load_model(str(tiny_dir), "cpu", "bfloat16", prepack="false")
    assert linears(off.model) == (15, 0) and off.prepack == "off: PREPACK=false"
    fp32 = load_model(str(tiny_dir), "cpu", "float32")  # never reordered in place: a copy, for batched rows only
    assert linears(fp32.model) == (0, 0) and fp32.prepack.startswith("on: 15 linear layers, with fp32 copies")
    assert sum(type(m).__name__ == "BatchRowsLinear" for m in fp32.model.modules()) == 15  # app/models/batch_rows.py
    half = load_model(str(tiny_dir), "cpu", "float16")
    assert linears(half.model) == (15, 0) and half.prepack.startswith("off: prepacking applies to bfloat16 and float32")


@pytest.mark.parametrize(("value", "mode"), [("auto", "auto"), ("true", "true"), ("1", "true"), ("on", "true"),
                                             ("false", "false"), ("0", "false"), ("No", "false")])
def test_prepack_setting_is_auto_true_or_false(monkeypatch, value, mode):
    monkeypatch.setenv("PREPACK", value)
    assert Settings().prepack == mode
    assert Settings(prepack=mode == "true").prepack == ("true" if mode == "true" else "false")  # --[no-]prepack


def test_prepack_setting_rejects_other_values(monkeypatch):
    monkeypatch.setenv("PREPACK", "sometimes")
    with pytest.raises(ValueError, match="prepack"):
        Settings()


def test_a_reorder_that_raises_leaves_plain_layers_and_one_log_line(tiny_tokenizer, monkeypatch, caplog):
    """What an AVX2-only CPU did before: oneDNN's reorder raised and the server died while loading."""
    def refuse(self, linear, *hint):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or "
                           "avx512bw, avx512vl and avx512dq")

    model = build_tiny_model(len(tiny_tokenizer)).to(torch.bfloat16)
    monkeypatch.setattr(PackedLinear, "__init__", refuse)
    with caplog.at_level(logging.WARNING, logger="app.models.prepack"):
        assert prepack_linears(model) == 0
    assert linears(model) == (15, 0)
    assert len(caplog.records) == 1 and "could not reorder" in caplog.text
    with pytest.raises(PrepackFailed, match="avx512bw"):
        prepack_linears(model, strict=True)
    ids = torch.tensor([tiny_tokenizer.encode("def reverse(s):")])
    with torch.inference_mode():
        assert torch.isfinite(model(ids).logits).all()  # and it still runs


def test_the_real_reorder_never_crashes_on_this_cpu(tiny_tokenizer):
    """Runs oneDNN's own reorder, whatever this CPU is: packed where it runs, plain where it raises."""
    model = build_tiny_model(len(tiny_tokenizer)).to(torch.bfloat16)
    packed = prepack_linears(model)
    assert linears(model) == ((0, 15) if packed else (15, 0))


def test_prepack_true_fails_at_start_where_it_cannot_run(tiny_dir):
    if CAN_PREPACK:
        assert load_model(str(tiny_dir), "cpu", "bfloat16", prepack="true").prepack == "on: 15 linear layers"
    else:
        with pytest.raises(ConfigError, match="PREPACK=true, but cpu .* lacks what oneDNN's bf16 reorder needs") as err:
            load_model(str(tiny_dir), "cpu", "bfloat16", prepack="true")
        assert err.value.param == "prepack"
    with pytest.raises(ConfigError, match="PREPACK=true, but prepacking applies to bfloat16 and float32 weights; "
                                          "these are float16 \\(dtype: dtype=float16 was asked for\\)") as err:
        load_model(str(tiny_dir), "cpu", "float16", prepack="true")
    assert err.value.param == "prepack"


@needs_prepack
def test_a_tied_lm_head_is_not_stored_twice(tiny_tokenizer):
    """SmolLM2 ties lm_head to the input embedding. A packed copy would hold those weights a second time (56 MB of
    its 270 MB in bf16), since the embedding still needs the plain layout: the tied layer stays plain."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    before = weight_bytes_held(model)
    ids = torch.tensor([tiny_tokenizer.encode("The capital of France is")])
    with torch.inference_mode():
        plain_logits = model(ids).logits
    assert prepack_linears(model) == 2 * 7  # every layer's linears; not lm_head
    assert type(model.lm_head) is nn.Linear
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert weight_bytes_held(model) == before
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, plain_logits)


def weight_bytes_held(model) -> int:
    """Every distinct weight storage, plain or packed, counted once."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    packed = [m.weight_bytes for m in model.modules() if isinstance(m, PackedLinear)]
    return sum(storages.values()) + sum(packed)


@needs_prepack
def test_bench_generate_reports_every_contender_and_exact_kv_memory(tiny_dir, tmp_path, capsys):
    args = argparse.Namespace(model=str(tiny_dir), device="cpu", dtype="bfloat16", prepack=None, max_tokens=8,
                              repeats=1, kv_streams=2, kv_tokens=32, out=str(tmp_path / "bench.json"), profile=4)
    result = bench_generate.run(args)
    printed = capsys.readouterr().out
    for label in ("our loop, prepacked", "our loop, plain weights", "model.generate(), plain", "floor",
                  "our loop, QUANT=int8"):
        assert label in printed
    assert result["prepacked"] is True
    for key in ("ours", "ours_plain", "hf_generate", "hf_generate_prepacked", "ours_int8"):
        assert result[f"{key}_tokens_per_s"] > 0
    assert result["kv_bytes_held"] == result["kv_bytes_theory"] == 2 * 32 * 2 * 2 * 2 * 16 * 2
    # --profile: the step's time split by where it goes, the parts adding up to the profiled step
    split = result["profile_ms_per_step"]
    assert min(split["linears"], split["attention"], split["other ops"]) > 0
    assert 0 < split["lm_head's ops"] < split["step, profiled"]  # the head's every op, its int8 matmul and more
    parts = split["linears"] + split["attention"] + split["other ops"] + split["outside any op"]
    assert parts == pytest.approx(split["step, profiled"]) and split["step, not profiled"] > 0
    assert "a decode step of our loop, ms: linears" in printed
    written = json.loads((tmp_path / "bench.json").read_text())
    assert written["bench"] == "generate" and written["machine"]["cores"] >= 1 and written["ours_vs_hf"] > 0


@needs_prepack
def test_a_bf16_checkpoint_packed_in_place_keeps_nothing_of_its_file(tiny_tokenizer, tmp_path):
    """transformers maps a bf16 checkpoint served in bf16 and hands out views of it. The packed weights are new
    memory, but a view left (the embedding table) kept the whole file mapped, and every page that packing read
    counted in the server's RSS (about 950 MiB of a 0.5B model's bf16 file, Zen 5): after packing, nothing of the
    file is left, and the model answers as before."""
    import gc
    from pathlib import Path

    build_tiny_model(len(tiny_tokenizer)).to(torch.bfloat16).save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    mapped = lambda: str(tmp_path / "model.safetensors") in Path("/proc/self/maps").read_text()  # noqa: E731
    lm = load_model(str(tmp_path), "cpu", "bfloat16", prepack="true", batch_invariant="off")
    gc.collect()
    assert lm.prepack.startswith("on") and linears(lm.model)[1] > 0
    assert not mapped(), "the checkpoint is still mapped"
    assert len(greedy(lm.model, tiny_tokenizer, [1, 2, 3, 4], lm.eos_ids, n=6)) == 6


@needs_prepack
def test_packing_frees_each_swapped_out_weight_as_it_goes(tiny_tokenizer, monkeypatch):
    """Packing in place holds at most the layer being packed beside the packed ones: a list of every linear kept
    all the swapped-out weights alive to the end, and packing peaked at twice the model."""
    import weakref

    import app.models.prepack as prepack

    model = build_tiny_model(len(tiny_tokenizer)).to(torch.bfloat16)
    originals = [weakref.ref(m.weight) for m in model.modules() if type(m) is torch.nn.Linear]
    alive_at_each_packing: list[int] = []
    real = prepack.PackedLinear

    class Counting(real):
        def __init__(self, linear, *args, **kwargs):
            alive_at_each_packing.append(sum(ref() is not None for ref in originals))
            super().__init__(linear, *args, **kwargs)

    monkeypatch.setattr(prepack, "PackedLinear", Counting)
    assert prepack_linears(model) == len(originals)
    # the k-th packing sees the layers not yet packed, the one being packed, and at most the previous one
    assert all(alive <= len(originals) - k + 1 for k, alive in enumerate(alive_at_each_packing))
    assert sum(ref() is not None for ref in originals) == 0
