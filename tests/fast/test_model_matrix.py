"""The architecture matrix: for each popular family, a tiny random model of it (tests/arch_models.py) served in fp32
on every engine path, each path's greedy tokens compared with `model.generate()`'s, one request alone.

A path either gives exactly those tokens, or the engine turns it off for this model and says why (the row then
records `off: why`, and the tokens are still `generate()`'s); it never serves different tokens. Each family's row
must equal the one recorded in docs/results/model-matrix.json, from which docs/models.md's table is generated
(benchmarks/models_table.py; tests/fast/test_docs.py checks the page). A change that turns a path on or off for a
family fails here until it is recorded: `RECORD_MODEL_MATRIX=1 pytest tests/fast/test_model_matrix.py`, then
`make docs-figures`.

The paths: `solo` (each request alone), `batched` (four at once: one packed pass, or one request per pass where
the model's attention is not packed), `chunked` (prompts prefilled 5 tokens a step beside decoding rows),
`prefix_cache` (the same prompt again, from the first one's cached blocks: a hit is required), `speculation`
(n-gram drafts: some must be verified), `compiled` (DECODE_STEP=compiled's pooled decode step, here without
inductor so the matrix stays fast; tests/compile/test_model_matrix_compiled.py compiles it for two families), and
`int8` / `int4` (QUANT: not exact by design, so only whether four batched requests are served every token, no
error: `serves` in the table, and whether MoE experts stayed unquantized), and `lora` (a random peft adapter on
every `o_proj`, four requests under it beside one on the base, against peft's merged model's `generate()`).
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import os
from pathlib import Path

import pytest
import torch

import app.core.engine.engine as engine_module
from app.core.engine.prefix_cache import keeps_all_keys
from app.core.runner.static_step import build_decode_step, pooled_step_problem
from app.core.sampling import SamplingParams
from app.models.loading import LoadedModel
from app.models.quant import quantize_linears
from arch_models import FAMILIES, build
from engine_runs import run_engine

RECORDED = Path(__file__).resolve().parents[2] / "docs" / "results" / "model-matrix.json"
PATHS = ("solo", "batched", "chunked", "prefix_cache", "speculation", "compiled", "int8", "int4", "lora")
TEXTS = ("The capital of France is Paris. Paris is a city on the Seine.", "def reverse(s):\n    return s[::-1]",
         "北京是中国的首都。上海是一个大城市。", "Emoji are fun: 😀 🎉 🚀 and so is café")
N = 12
SPECULATED = 32
GREEDY = SamplingParams(max_tokens=N, do_sample=False, ignore_eos=True)

pytestmark = pytest.mark.full  # ~1-2 s a family


def verdict(seen, expected: list[list[int]]) -> str:
    return "exact" if [s.tokens for s in seen] == expected else "DIFFERS from generate()"


def off(reason: str) -> str:
    """The short reason a row gives for a path the engine turned off (the start log says it in full)."""
    for marker, short in (("eager", "eager attention"), ("sliding", "sliding window"),
                          ("not packed", "not packed")):
        if marker in reason:
            return f"off: {short}"
    return f"off: {reason}"


def matrix_row(family: str, tokenizer, monkeypatch, tmp_path) -> dict[str, str]:
    model = build(family, len(tokenizer))
    prompts = [tokenizer.encode(text) for text in TEXTS]
    expected = [model.generate(torch.tensor([p]), max_new_tokens=N, min_new_tokens=N, do_sample=False)[0, len(p):]
                .tolist() for p in prompts]
    lm = LoadedModel(model=model, tokenizer=tokenizer, name=family, max_context=256, eos_ids=())
    requests = [(p, GREEDY) for p in prompts]
    row = {}

    seen, _ = run_engine(lm, requests)
    row["solo"] = verdict(seen, expected)
    seen, engine = run_engine(lm, requests, together=True)
    row["batched"] = verdict(seen, expected) + ("" if engine.batch_decode else ", one per pass")
    packed = engine.batch_decode
    seen, _ = run_engine(lm, requests, together=True, prefill_tokens_per_step=5)
    row["chunked"] = verdict(seen, expected)

    seen, engine = run_engine(lm, [requests[0]] * 2, prefix_cache_bytes=1 << 22)
    if engine.prefix_cache is None:
        assert not keeps_all_keys(model.config)
        row["prefix_cache"] = off("sliding window")
    else:
        assert seen[1].cached_tokens > 0, "the second request must start from the first one's cached blocks"
        row["prefix_cache"] = verdict(seen, [expected[0]] * 2)

    # longer answers: a random model's greedy text falls into a loop, whose n-grams give drafts to verify
    longer = SamplingParams(max_tokens=SPECULATED, do_sample=False, ignore_eos=True)
    seen, engine = run_engine(lm, [(p, longer) for p in prompts], together=True, speculative="ngram")
    if engine.speculative == "off":
        row["speculation"] = off("not packed" if not packed else "sliding window")
    else:
        assert engine.metrics.draft_tokens._value.get() > 0, "no draft was verified: the path went untested"
        row["speculation"] = verdict(seen, [model.generate(torch.tensor([p]), max_new_tokens=SPECULATED,
                                                           min_new_tokens=SPECULATED, do_sample=False)[0, len(p):]
                                            .tolist() for p in prompts])

    # the pooled decode step without inductor: the same arithmetic the compiled one runs, minus the compiler's fusing
    monkeypatch.setattr(engine_module, "build_decode_step", functools.partial(build_decode_step, compile=False))
    seen, engine = run_engine(lm, requests, together=True, decode_step="compiled")
    if (why := pooled_step_problem(lm, packed)) is not None:
        assert engine._runner.static_decode is None
        row["compiled"] = off(why)
    else:
        assert engine.metrics.decode_steps.labels(path="pooled")._value.get() > 0
        row["compiled"] = verdict(seen, expected)

    for mode in ("int8", "int4"):
        quantized = copy.deepcopy(model)
        quantize_linears(quantized, mode)
        seen, _ = run_engine(LoadedModel(model=quantized, tokenizer=tokenizer, name=family, max_context=256,
                                         eos_ids=()), requests, together=True)
        served = all(len(s.tokens) == N and s.finish_reason == "length" for s in seen)
        # MoE experts are fused 3D parameters, not the nn.Linear layers QUANT replaces: they keep the load dtype
        experts = any(p.ndim == 3 and p.is_floating_point() for p in quantized.parameters())
        row[mode] = ("serves" + (", experts not quantized" if experts else "")) if served else "fails"
    row["lora"] = lora_cell(family, tokenizer, prompts, tmp_path)
    return row


def lora_cell(family: str, tokenizer, prompts: list[list[int]], tmp_path) -> str:
    """A random peft adapter on every attention output projection (`o_proj`, which every family has), served to
    all four requests at once beside one on the base model: its tokens against peft's merged model's generate()."""
    from peft import LoraConfig, get_peft_model

    from app.models.lora import LoraAdapters
    from test_lora import serve

    torch.manual_seed(1)
    peft_model = get_peft_model(build(family, len(tokenizer)), LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"],
                                                                          init_lora_weights=False))
    with torch.no_grad():  # peft's non-zero init is small next to the tiny model's weights: make it matter
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.3)
    peft_model.save_pretrained(tmp_path / "adapter")
    merged = peft_model.merge_and_unload().eval()
    expected = [merged.generate(torch.tensor([p]), max_new_tokens=N, min_new_tokens=N, do_sample=False)[0, len(p):]
                .tolist() for p in prompts]
    base = build(family, len(tokenizer))  # a fresh copy: serving wraps its linears
    base_expected = base.generate(torch.tensor([prompts[0]]), max_new_tokens=N, min_new_tokens=N,
                                  do_sample=False)[0, len(prompts[0]):].tolist()
    lm = LoadedModel(model=base, tokenizer=tokenizer, name=family, max_context=256, eos_ids=())
    tokens, _, _ = serve(lm, LoraAdapters(family, {"adapter": str(tmp_path / "adapter")}),
                         [(p, "adapter") for p in prompts] + [(prompts[0], None)], n=N)
    assert expected[0] != base_expected, "the adapter must change the answer, or the check proves nothing"
    return "exact" if tokens == expected + [base_expected] else "DIFFERS from generate()"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_path_gives_generates_tokens_or_is_off_with_a_reason(family, tiny_tokenizer, monkeypatch, tmp_path):
    row = matrix_row(family, tiny_tokenizer, monkeypatch, tmp_path)
    assert list(row) == list(PATHS)
    assert not [path for path, cell in row.items() if "DIFFERS" in cell or cell == "fails"], row
    if os.environ.get("RECORD_MODEL_MATRIX"):
        record_row(family, row)
    assert json.loads(RECORDED.read_text())["families"].get(family) == row, (
        f"{family}: the matrix changed; record it (RECORD_MODEL_MATRIX=1) and run `make docs-figures`")


def record_row(family: str, row: dict[str, str]) -> None:
    """Into docs/results/model-matrix.json, in the results' envelope (where, when, on which versions)."""
    from benchmarks import record

    recorded = json.loads(RECORDED.read_text()) if RECORDED.exists() else {"families": {}}
    families = recorded["families"] | {family: row}
    RECORDED.write_text(json.dumps({
        "schema": record.SCHEMA, "bench": "models",
        "source": "RECORD_MODEL_MATRIX=1 pytest tests/fast/test_model_matrix.py",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": record.machine(), "versions": record.versions(), "settings": {"dtype": "float32", "max_tokens": N},
        "families": {f: families[f] for f in FAMILIES if f in families}}, indent=1, ensure_ascii=False) + "\n")


def test_the_record_holds_every_family_and_no_other():
    assert list(json.loads(RECORDED.read_text())["families"]) == list(FAMILIES)
