"""fp32 on a CPU: the wide linears of the engine's passes compute several rows as `W @ x.T`
(app/models/weight_first.py). Outside those passes, and for one row, they are exactly `nn.Linear`."""

from __future__ import annotations

import torch
from torch import nn

from app.core.generate import Sequence, decode_step, forward_many, prefill
from app.core.sampling import SamplingParams
from app.models.loading import load_model
from app.models.weight_first import WeightFirstLinear, use_weight_first, weight_first_rows


def test_one_row_and_calls_outside_the_engine_are_nn_linear_bit_for_bit():
    torch.manual_seed(0)
    plain = nn.Linear(64, 400)
    wide = WeightFirstLinear(plain)
    x = torch.randn(1, 7, 64)
    with torch.inference_mode():
        assert torch.equal(wide(x), plain(x))  # outside an engine pass: F.linear itself
        with weight_first_rows():
            assert torch.equal(wide(x[:, :1]), plain(x[:, :1]))  # one row: F.linear itself
            alone = torch.cat([plain(x[:, i : i + 1]) for i in range(7)], dim=1)
            several = wide(x)
            torch.testing.assert_close(several, alone, rtol=1e-5, atol=1e-5)  # rounding only
            assert several.shape == (1, 7, 400) and several.is_contiguous()
        assert torch.equal(wide(x), plain(x))  # and the pass's end restores it


def test_load_model_swaps_only_wide_fp32_cpu_linears(tiny_dir):
    lm = load_model(str(tiny_dir), device="cpu", dtype="float32")
    wide = {name for name, m in lm.model.named_modules() if isinstance(m, WeightFirstLinear)}
    assert wide == {"lm_head"} | {f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj")}
    if lm.model.config.tie_word_embeddings:  # shares the table, never a copy
        assert lm.model.lm_head.weight is lm.model.get_input_embeddings().weight
    for dtype, quant in (("bfloat16", "none"), ("auto", "int8")):  # prepacking's and int8's own layers stay
        other = load_model(str(tiny_dir), device="cpu", dtype=dtype, quant=quant, prepack="false")
        assert not any(isinstance(m, WeightFirstLinear) for m in other.model.modules())
    assert use_weight_first(nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 4))) == 0  # narrow and square: kept


def test_engine_passes_give_the_article_loops_greedy_tokens(tiny_dir):
    """A batch of three through forward_many (W @ x.T in its wide linears) against each alone through the
    article's prefill / decode_step (nn.Linear's arithmetic): the same greedy tokens."""
    from app.core.batching import enable_packed_batching

    lm = load_model(str(tiny_dir), device="cpu", dtype="float32")
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
    logits = forward_many(lm.model, [(s, s.prompt_len) for s in seqs])
    together = [[s.choose(logits[i : i + 1]).token_id] for i, s in enumerate(seqs)]
    while len(together[0]) < 16:
        logits = forward_many(lm.model, [(s, 1) for s in seqs])
        for i, s in enumerate(seqs):
            together[i].append(s.choose(logits[i : i + 1]).token_id)
    assert together == [alone(ids) for ids in prompts]
