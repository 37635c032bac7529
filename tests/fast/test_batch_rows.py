"""fp32 on a CPU: the engine's passes compute several rows on faster kernels (app/models/batch_rows.py): a
oneDNN-packed copy of each linear where it fits, else the wide ones as `W @ x.T`. Outside those passes, and for
one row, every linear is exactly `nn.Linear`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from app.core.generate import decode_step, prefill
from app.core.runner.forward import forward
from app.core.sequence import Sequence
from app.core.sampling import SamplingParams
from app.errors import ConfigError
from app.models import batch_rows
from app.models.batch_rows import PACKED_MAX_ROWS, BatchRowsLinear, use_batch_rows
from app.models.loading import load_model


def swapped(model) -> dict[str, bool]:
    """name -> whether it holds a packed copy, for every BatchRowsLinear."""
    return {name: m.packed_weight is not None for name, m in model.named_modules() if isinstance(m, BatchRowsLinear)}


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize(("n_in", "n_out", "bias"), [(64, 400, True), (400, 64, False), (96, 96, True)])
def test_one_row_and_calls_outside_the_engine_are_nn_linear_bit_for_bit(packed, n_in, n_out, bias):
    torch.manual_seed(0)
    plain = nn.Linear(n_in, n_out, bias=bias)
    layer = BatchRowsLinear(plain, packed)
    with torch.inference_mode():
        for rows in (7, PACKED_MAX_ROWS + 9):  # the packed kernel's range, and past it
            x = torch.randn(1, rows, n_in)
            assert torch.equal(layer(x), plain(x))  # outside an engine pass: F.linear itself
            with batch_rows.batch_rows():
                assert torch.equal(layer(x[:, :1]), plain(x[:, :1]))  # one row: F.linear itself
                alone = torch.cat([plain(x[:, i : i + 1]) for i in range(rows)], dim=1)
                several = layer(x)
                torch.testing.assert_close(several, alone, rtol=1e-5, atol=1e-5)  # rounding only
                assert several.shape == (1, rows, n_out) and several.is_contiguous()
            assert torch.equal(layer(x), plain(x))  # and the pass's end restores it


def test_prepack_auto_gives_every_fp32_linear_a_packed_copy(tiny_dir):
    lm = load_model(str(tiny_dir), device="cpu", dtype="float32")
    names = {"lm_head"} | {f"model.layers.{i}.{p}" for i in range(2) for p in
                           ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert swapped(lm.model) == dict.fromkeys(names, True)
    assert lm.prepack.startswith("on: 15 linear layers, with fp32 copies for batched rows (")
    if lm.model.config.tie_word_embeddings:  # shares the table; only the packed copy is new
        assert lm.model.lm_head.weight is lm.model.get_input_embeddings().weight


def test_prepack_false_keeps_no_copies_and_only_the_wide_linears_change(tiny_dir):
    # BATCH_INVARIANT=off: invariance puts every linear on a checked kernel (test_invariant_linears.py)
    lm = load_model(str(tiny_dir), device="cpu", dtype="float32", prepack="false", batch_invariant="off")
    wide = {"lm_head"} | {f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj")}
    assert swapped(lm.model) == dict.fromkeys(wide, False) and lm.prepack == "off: PREPACK=false"
    for dtype, quant in (("bfloat16", "none"), ("auto", "int8")):  # prepacking's and int8's own layers stay
        other = load_model(str(tiny_dir), device="cpu", dtype=dtype, quant=quant, prepack="false")
        assert swapped(other.model) == {}
    assert use_batch_rows(nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 4)), packed=False) == 0  # nothing to gain


def test_copies_that_would_crowd_the_ram_are_left_out_or_refused(tiny_dir, monkeypatch):
    need = sum(p.numel() * 4 for n, p in load_model(str(tiny_dir), "cpu", "float32", prepack="false")
               .model.named_parameters() if n.endswith("proj.weight")) + 1  # at least this much
    monkeypatch.setattr("app.models.loading.psutil.virtual_memory", lambda: SimpleNamespace(available=need))
    lm = load_model(str(tiny_dir), device="cpu", dtype="float32")
    assert lm.prepack.startswith("off: fp32 copies for batched rows would take ")
    assert lm.prepack.endswith(" MiB of RAM available")
    assert not any(swapped(lm.model).values()) and swapped(lm.model)  # the wide ones still take `W @ x.T`
    with pytest.raises(ConfigError, match="PREPACK=true, but fp32 copies for batched rows would take") as err:
        load_model(str(tiny_dir), device="cpu", dtype="float32", prepack="true")
    assert err.value.param == "prepack"


def test_a_packed_kernel_that_is_off_leaves_the_model_plain_and_working(tiny_dir, monkeypatch):
    monkeypatch.setattr(batch_rows, "packed_linear", lambda x, w, b: torch.zeros(*x.shape[:-1], w.size(0)))
    lm = load_model(str(tiny_dir), device="cpu", dtype="float32")
    assert lm.prepack.startswith("off: oneDNN's packed fp32 linear (") and "gave different results" in lm.prepack
    assert not any(swapped(lm.model).values())
    with pytest.raises(ConfigError, match="PREPACK=true, but oneDNN's packed fp32 linear"):
        load_model(str(tiny_dir), device="cpu", dtype="float32", prepack="true")
    from app.core.runner.packed import enable_packed_batching

    assert enable_packed_batching(lm.model)
    seqs = [Sequence(lm.model, lm.tokenizer, list(range(5, 5 + n)), SamplingParams(max_tokens=2, do_sample=False),
                     (), lm.max_context) for n in (3, 4)]
    assert forward(lm.model, [(s, s.prompt_len) for s in seqs]).abs().sum() > 0  # not the broken kernel


def test_each_shape_is_checked_once_and_a_kernel_off_for_a_later_shape_is_still_caught(monkeypatch):
    checked = []
    real_check = batch_rows._check_close
    monkeypatch.setattr(batch_rows, "_check_close",
                        lambda plain, layer: (checked.append(plain), real_check(plain, layer)))
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(4, 6), nn.Linear(8, 4, bias=False))
    assert use_batch_rows(model, packed=True) == 4
    assert [(m.out_features, m.in_features, m.bias is not None) for m in checked] == [(4, 8, True), (6, 4, True),
                                                                                      (4, 8, False)]
    real_packed = batch_rows.packed_linear
    monkeypatch.setattr(batch_rows, "packed_linear",  # off for the 6 x 4 shape only, the second one met
                        lambda x, w, b: real_packed(x, w, b) * (1.5 if b is not None and b.numel() == 6 else 1))
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 6))
    with pytest.raises(RuntimeError, match=r"oneDNN's packed fp32 linear \(6 x 4\) gave different results"):
        use_batch_rows(model, packed=True)
    assert all(type(m) is nn.Linear for m in model)  # nothing was swapped


@pytest.mark.full
@pytest.mark.parametrize("prepack", ["auto", "false"])
def test_engine_passes_give_the_article_loops_greedy_tokens(tiny_dir, prepack):
    """A batch of three through forward (the packed copies, or `W @ x.T`) against each alone through the
    article's prefill / decode_step (nn.Linear's arithmetic): the same greedy tokens."""
    from app.core.runner.packed import enable_packed_batching

    lm = load_model(str(tiny_dir), device="cpu", dtype="float32", prepack=prepack)
    assert enable_packed_batching(lm.model)
    prompts = [list(range(5, 5 + n)) for n in (7, 12, 19)]
    params = SamplingParams(max_tokens=16, do_sample=False, ignore_eos=True)

    def alone(ids):
        seq = Sequence(lm.model, lm.tokenizer, ids, params, (), lm.max_context)
        tokens = [seq.choose(prefill(lm.model, seq)).token_id]
        while len(tokens) < 16:
            tokens.append(seq.choose(decode_step(lm.model, seq)).token_id)
        return tokens

    seqs = [Sequence(lm.model, lm.tokenizer, ids, params, (), lm.max_context) for ids in prompts]
    logits = forward(lm.model, [(s, s.prompt_len) for s in seqs])
    together = [[s.choose(logits[i : i + 1]).token_id] for i, s in enumerate(seqs)]
    while len(together[0]) < 16:
        logits = forward(lm.model, [(s, 1) for s in seqs])
        for i, s in enumerate(seqs):
            together[i].append(s.choose(logits[i : i + 1]).token_id)
    assert together == [alone(ids) for ids in prompts]
