"""Loading the same way on every start and every CPU: dtype=auto from features alone, the capability rules behind it
(with AVX2 emulated through ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA), straight-to-device loading, and what
/ready and /v1/models report. `make test` runs this file a second time with AVX2 forced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from torch import nn

from app.config import Settings
from app.core.generate import generate
from app.core.sampling import SamplingParams
from app.errors import ConfigError
from app.models import cpu as cpu_module
from app.models.cpu import CpuFeatures, auto_dtype, cpu_features, prepack_support
from app.models.loading import load_model, resolve_dtype
from app.models.prepack import PackedLinear

from conftest import MODEL_CACHE, ThreadServer
from cpu_flags import PRE_AVX2_FLAGS, SAPPHIRE_RAPIDS_FLAGS, SKYLAKE_X_FLAGS, ZEN3_FLAGS, ZEN4_FLAGS, ZEN5_FLAGS

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
ZEN4 = CpuFeatures(name="AMD EPYC", aten_capability="AVX512", onednn_max_isa=None, onednn_bf16=True,
                   flags=frozenset({"avx512_bw", "avx512_vl", "avx512_dq", "avx512_bf16"}))
AVX2_ONLY = CpuFeatures(name="AMD EPYC", aten_capability="AVX2", onednn_max_isa=None, onednn_bf16=False,
                        flags=frozenset())


def test_auto_dtype_on_cpu_is_bf16_only_with_native_bf16_dot_products():
    assert auto_dtype(CPU, ZEN4) == (torch.bfloat16, "cpu AMD EPYC (AVX512) has native bf16 dot products "
                                                     "(AVX512_BF16)")
    amx = replace(ZEN4, flags=frozenset({"avx512_bw", "avx512_vl", "avx512_dq", "amx_tile", "amx_bf16"}))
    assert auto_dtype(CPU, amx)[0] == torch.bfloat16 and "AMX-BF16" in auto_dtype(CPU, amx)[1]
    skylake = replace(ZEN4, flags=frozenset({"avx512_bw", "avx512_vl", "avx512_dq"}))  # AVX-512, no bf16 dot
    for features in (skylake, AVX2_ONLY, replace(AVX2_ONLY, flags=frozenset({"avx_ne_convert"}), onednn_bf16=True)):
        dtype, reason = auto_dtype(CPU, features)
        assert dtype == torch.float32 and "no native bf16 dot products" in reason


def test_prepack_needs_what_onednns_reorder_checks():
    assert prepack_support(CPU, torch.bfloat16, ZEN4) is None
    assert "lacks what oneDNN's bf16 reorder needs (AVX512BW+AVX512VL+AVX512DQ" in prepack_support(
        CPU, torch.bfloat16, AVX2_ONLY)
    arrow_lake = replace(AVX2_ONLY, flags=frozenset({"avx_ne_convert"}), onednn_bf16=True)  # AVX2 + AVX-NE-CONVERT
    assert prepack_support(CPU, torch.bfloat16, arrow_lake) is None
    assert prepack_support(CPU, torch.float16, ZEN4).startswith("prepacking applies to bfloat16 and float32")
    assert prepack_support(CPU, torch.float32, AVX2_ONLY) is None  # a copy for batched rows: oneDNN's fp32 kernels
    assert prepack_support(torch.device("cuda"), torch.bfloat16, ZEN4).startswith("prepacking is for the CPU")


FEATURES_SCRIPT = ("import json, torch; from app.models.cpu import cpu_features, auto_dtype, prepack_support; "
                   "f = cpu_features(); print(json.dumps({'flags': sorted(f.flags), 'aten': f.aten_capability, "
                   "'dtype': str(auto_dtype(torch.device('cpu'))[0]), "
                   "'prepack': prepack_support(torch.device('cpu'), torch.bfloat16)}))")


@pytest.mark.full
@pytest.mark.parametrize("forced", [{"ATEN_CPU_CAPABILITY": "avx2"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"}])
def test_forcing_avx2_through_either_variable_emulates_an_avx2_only_cpu(forced):
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    out = subprocess.run([sys.executable, "-c", FEATURES_SCRIPT], env=env | forced, cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    seen = json.loads(out)
    assert not [f for f in seen["flags"] if f.startswith(("avx512", "amx"))]
    assert seen["dtype"] == "torch.float32"
    assert "lacks what oneDNN's bf16 reorder needs" in seen["prepack"] and "forced by" in seen["prepack"]


def test_dtype_auto_never_times_anything(monkeypatch):
    """The old probe timed bf16 against fp32 and flipped between starts. Rig bf16 linears to be 5 ms slower: the
    choice must not move, and must be the features' rule."""
    import time

    slow = {"calls": 0}

    def slow_bf16(forward):
        def run(self, x):
            if x.dtype == torch.bfloat16:
                slow["calls"] += 1
                time.sleep(0.005)
            return forward(self, x)
        return run

    monkeypatch.setattr(nn.Linear, "forward", slow_bf16(nn.Linear.forward))
    monkeypatch.setattr(PackedLinear, "forward", slow_bf16(PackedLinear.forward))
    expected = auto_dtype(CPU, cpu_features())
    assert [resolve_dtype("auto", CPU) for _ in range(3)] == [expected] * 3
    assert slow["calls"] == 0
    assert resolve_dtype("float32", CPU) == (torch.float32, "dtype=float32 was asked for")


def test_load_model_reports_its_dtype_and_why(tiny_dir):
    lm = load_model(str(tiny_dir), "cpu")
    assert (lm.dtype, lm.dtype_reason) == auto_dtype(CPU)
    if prepack_support(CPU, lm.dtype) is not None:
        assert lm.prepack.startswith("off: ")
    elif lm.dtype == torch.float32:
        assert lm.prepack.startswith("on: 15 linear layers")
    else:  # bf16: packed where it measured faster, with the figures (app/models/prepack.py)
        assert lm.prepack.startswith(("on: ", "off: plain measured faster")) and "plain/packed" in lm.prepack


def test_where_prepack_cannot_run_auto_serves_plain_layers_and_true_fails(tiny_dir, monkeypatch):
    monkeypatch.setattr(cpu_module, "cpu_features", lambda: AVX2_ONLY)
    lm = load_model(str(tiny_dir), "cpu", "bfloat16")  # auto
    assert not any(isinstance(m, PackedLinear) for m in lm.model.modules())
    assert lm.prepack.startswith("off: cpu AMD EPYC (AVX2) lacks what oneDNN's bf16 reorder needs")
    events = list(generate(lm.model, lm.tokenizer, lm.encode_text("def reverse(s):"),
                           SamplingParams(max_tokens=4, do_sample=False, ignore_eos=True), lm.eos_ids, 256))
    assert len(events) == 4
    with pytest.raises(ConfigError, match="PREPACK=true, but cpu AMD EPYC \\(AVX2\\) lacks") as err:
        load_model(str(tiny_dir), "cpu", "bfloat16", prepack="true")
    assert err.value.param == "prepack"
    fp32 = load_model(str(tiny_dir), "cpu", "auto", prepack="true")  # fp32 here: its copy for batched rows runs
    assert fp32.dtype == torch.float32 and fp32.prepack.startswith("on: 15 linear layers, with fp32 copies")


def test_the_model_loads_straight_onto_its_device(tiny_dir, monkeypatch):
    """Loading on the CPU and then calling .to(device) holds the weights twice in host RAM on the way to a GPU.
    Streamed (app/models/streamed_load.py), from_pretrained is not called at all; where it is (here: the streamed
    load told that there are no files), it loads onto the device."""
    from transformers import AutoModelForCausalLM

    from app.models import streamed_load

    seen = {}
    from_pretrained = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.update(kwargs)
        return from_pretrained(cls, *args, **kwargs)

    def no_moves(self, *args, **kwargs):
        raise AssertionError(f"the model was moved after loading: .to{args}")

    def no_files(directory):
        raise streamed_load.NotStreamable("this test's")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    monkeypatch.setattr(nn.Module, "to", no_moves)
    lm = load_model(str(tiny_dir), "cpu", "float32")
    assert seen == {} and lm.device == CPU and lm.dtype == torch.float32
    monkeypatch.setattr(streamed_load, "_shards", no_files)
    lm = load_model(str(tiny_dir), "cpu", "float32")
    assert seen["device_map"] == CPU and seen["dtype"] == torch.float32
    assert lm.device == CPU and lm.dtype == torch.float32


@pytest.mark.full
def test_two_starts_give_identical_greedy_answers(tiny_dir):
    """Two processes, default settings (dtype=auto, PREPACK=auto): the same dtype and the same greedy text."""
    command = [sys.executable, "-m", "app", "generate", "--model", str(tiny_dir), "--raw", "--temperature", "0",
               "--max-tokens", "16", "def reverse(s):"]
    env = {k: v for k, v in os.environ.items() if k not in ("DTYPE", "PREPACK")}
    # side by side: each start is mostly one core's import work (minutes under make test-avx2's emulator)
    starts = [subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    try:
        runs = [subprocess.CompletedProcess(p.args, 0, *p.communicate(timeout=180)) for p in starts]
    finally:
        for p in starts:
            p.kill()
    assert [p.returncode for p in starts] == [0, 0], [r.stderr[-2000:] for r in runs]
    # the dtype line, not prepack's figures: those are timings (which layers pack may differ; the tokens may not)
    headers = [next(line for line in r.stderr.splitlines() if line.startswith("# dtype")).split("; prepack")[0]
               for r in runs]
    assert headers[0] == headers[1] and str(auto_dtype(CPU)[0]).removeprefix("torch.") in headers[0]
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.strip()


def test_ready_and_models_report_dtype_reason_and_prepack(tiny_dir):
    from app.main import create_app

    lm = load_model(str(tiny_dir), "cpu")
    with ThreadServer(create_app(Settings(model="tiny"), lm=lm)) as server:
        ready = httpx.get(f"{server.url}/ready").json()
        listed = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    expected = {"dtype": str(lm.dtype).removeprefix("torch."), "dtype_reason": lm.dtype_reason,
                "prepack": lm.prepack}
    assert {k: ready[k] for k in expected} == expected == {k: listed[k] for k in expected}
    assert expected["dtype_reason"] == auto_dtype(CPU)[1]


@pytest.mark.real_model
def test_smollm_loads_as_auto_chooses_and_keeps_generate_s_greedy_tokens():
    """The embedded SmolLM2 as a default start loads it on this CPU (bf16 + prepacked where the CPU has native bf16,
    fp32 with packed copies for batched rows on AVX2, each copy checked against nn.Linear on these real weights),
    and our loop gives `model.generate()`'s greedy tokens on those same weights."""
    lm = load_model(str(MODEL_CACHE / "smollm2-135m-instruct"), "cpu")
    assert (lm.dtype, lm.dtype_reason) == auto_dtype(CPU)
    if lm.dtype == torch.bfloat16:
        packed = any(isinstance(m, PackedLinear) for m in lm.model.modules())
        assert packed == (prepack_support(CPU, lm.dtype) is None)
    else:  # 30 layers x 7 linears and the tied lm_head
        assert lm.prepack.startswith("on: 211 linear layers, with fp32 copies for batched rows"), lm.prepack
    ids = lm.encode_chat([{"role": "user", "content": "Which city is the capital of France?"}])
    ours = [e.token_id for e in generate(lm.model, lm.tokenizer, ids, SamplingParams(max_tokens=24, do_sample=False),
                                         lm.eos_ids, lm.max_context)]
    with torch.inference_mode():
        hf = lm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               do_sample=False, max_new_tokens=24, eos_token_id=list(lm.eos_ids),
                               pad_token_id=0)[0, len(ids):].tolist()
    assert len(ours) >= 8 and ours == hf


# class: (dtype=auto, bf16 prepacking possible, QUANT=int8's engine)
CPU_CLASSES = {"AVX2 (Zen 3)": (ZEN3_FLAGS, torch.float32, False, "x86"),
               "AVX-512 (Skylake-X)": (SKYLAKE_X_FLAGS, torch.float32, True, "x86"),
               "AVX-512 + BF16 + VNNI (Zen 4)": (ZEN4_FLAGS, torch.bfloat16, True, "x86"),
               "AVX-512 + BF16 + VNNI + AVX-VNNI (Zen 5)": (ZEN5_FLAGS, torch.bfloat16, True, "x86"),
               "AMX (Sapphire Rapids)": (SAPPHIRE_RAPIDS_FLAGS, torch.bfloat16, True, "x86")}


@pytest.mark.parametrize("cpu_class", CPU_CLASSES)
def test_each_cpu_class_gets_its_kernels(cpu_class):
    from app.models.cpu import features_from_cpuinfo, int8_engine

    flags, dtype, bf16_prepack, engine = CPU_CLASSES[cpu_class]
    features = features_from_cpuinfo(flags, cpu_class)
    assert auto_dtype(CPU, features)[0] == dtype
    assert (prepack_support(CPU, torch.bfloat16, features) is None) == bf16_prepack
    assert prepack_support(CPU, torch.float32, features) is None  # fp32 copies: oneDNN's fp32 kernels run anywhere
    chosen, why = int8_engine(features, ["qnnpack", "onednn", "x86", "fbgemm"])
    assert chosen == engine and cpu_class in why
    assert ("AVX512-VNNI" in why) == ("avx512_vnni" in flags)
    amx = "amx_int8" in flags
    # AMX too: oneDNN's packed int8 weights keep their original beside them, bf16's bytes (app/models/cpu.py)
    assert ("not oneDNN's AMX-INT8, whose packed weights keep their int8 original too" in why) == amx
    # a torch without fbgemm: oneDNN only where it brings AMX; otherwise no dynamic int8 (weight-only instead)
    assert int8_engine(features, ["qnnpack", "onednn"])[0] == ("onednn" if amx else None)
    assert int8_engine(features, ["qnnpack"])[0] is None
    assert int8_engine(features_from_cpuinfo(PRE_AVX2_FLAGS), ["onednn", "x86"]) == (
        None, "cpu x86 (DEFAULT) has no AVX2, which fbgemm and oneDNN's int8 kernels need")


CPUINFO_FLAGS = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                     None) if Path("/proc/cpuinfo").is_file() else None


@pytest.mark.skipif(CPUINFO_FLAGS is None or bool(cpu_features().forced),
                    reason="no /proc/cpuinfo, or features forced by env vars")
@pytest.mark.skipif(CPUINFO_FLAGS is not None and bool(torch.cpu.get_capabilities().get("avx512_f"))
                    != ("avx512f" in CPUINFO_FLAGS.split()),
                    reason="CPUID and /proc/cpuinfo disagree: an emulated CPU (make test-avx2)")
def test_this_machines_flags_read_as_torch_reads_them():
    """The cpuinfo reader agrees with torch's own view on this machine, so the classes above are read the same way."""
    flags, here = CPUINFO_FLAGS, cpu_features()
    from app.models.cpu import features_from_cpuinfo

    from_line = features_from_cpuinfo(flags)
    assert from_line.flags == here.flags and from_line.aten_capability == here.aten_capability


def test_a_loaded_tokenizer_drops_its_python_vocabulary_and_tokenizes_as_before(tiny_dir, tmp_path):
    """transformers' Qwen2Tokenizer keeps the Python vocabulary and merges it built its Rust tokenizer from (64 MiB
    of objects for Qwen2.5's 151,936 tokens). The server's copy drops them and still encodes, decodes, lists its
    vocabulary and renders the chat template as a freshly loaded one does."""
    import shutil

    from transformers import AutoTokenizer

    model_dir = tmp_path / "qwen2-tokenizer"
    shutil.copytree(tiny_dir, model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    fresh = AutoTokenizer.from_pretrained(model_dir)
    assert type(fresh).__name__ == "Qwen2Tokenizer" and len(fresh._vocab) == len(fresh) and fresh._merges
    lm = load_model(str(model_dir), "cpu", "float32")
    assert type(lm.tokenizer) is type(fresh)
    assert not hasattr(lm.tokenizer, "_vocab") and not hasattr(lm.tokenizer, "_merges")
    text = "def reverse(s):\n    return s[::-1]  # hello world"
    ids = fresh.encode(text)
    assert lm.tokenizer.encode(text) == ids and lm.tokenizer.decode(ids) == fresh.decode(ids) == text
    assert lm.tokenizer.get_vocab() == fresh.get_vocab()
    messages = [{"role": "user", "content": text}]
    assert lm.encode_chat(messages) == fresh.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                                 return_dict=False)

