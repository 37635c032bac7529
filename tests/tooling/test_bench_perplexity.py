"""`python -m benchmarks perplexity`: our side scores exactly as `llama-perplexity` does (windows of ctx tokens, the
first replaced by BOS where the vocabulary adds one, each window's second half scored), whatever the pass size."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from benchmarks import perplexity


def llama_style(model, ids: list[int], ctx: int, bos: int | None) -> float:
    """llama-perplexity's sum, written out on the plain transformers model: one forward per window."""
    first, nll, count = ctx // 2, 0.0, 0
    for start in range(0, len(ids) // ctx * ctx, ctx):
        window = ids[start:start + ctx]
        window[0] = window[0] if bos is None else bos
        logits = model(torch.tensor([window])).logits[0].float()
        nll += torch.nn.functional.cross_entropy(logits[first:ctx - 1], torch.tensor(window[first + 1:]),
                                                 reduction="sum").item()
        count += ctx - 1 - first
    return math.exp(nll / count)


@pytest.mark.parametrize("chunk", [7, 16, 32])
@pytest.mark.parametrize("bos", [None, 1])
def test_ours_scores_the_tokens_llama_perplexity_scores(tiny_lm, chunk, bos):
    ids = tiny_lm.encode_text("The capital of France is Paris, a city on the Seine. " * 12)[:100]  # 3 windows + 4
    with torch.inference_mode():
        expected = llama_style(tiny_lm.model, ids, 32, bos)
        served = perplexity.served_perplexity(tiny_lm, list(ids), 32, chunk, bos, kv_int8=False)
    assert served == pytest.approx(expected, rel=1e-5)
    with torch.inference_mode():
        eight = perplexity.served_perplexity(tiny_lm, list(ids), 32, chunk, bos, kv_int8=True)
    assert eight != served and eight == pytest.approx(served, rel=0.05)  # the 8-bit cache rounds what it reads


def test_a_model_that_is_no_gguf_file_is_refused_naming_the_flag(tmp_path):
    parser = argparse.ArgumentParser()
    perplexity.add_arguments(parser)
    with pytest.raises(SystemExit, match="--model: .*not a .gguf file"):
        perplexity.run(parser.parse_args(["--model", str(tmp_path / "model.safetensors")]))


def test_llama_perplexitys_final_estimate_is_read():
    printed = b"[1]9.1,[2]10.2\nFinal estimate: PPL = 10.2345 +/- 0.31416\nllama_perf_context_print: ..."
    found = perplexity.FINAL.search(printed)
    assert (float(found[1]), float(found[2])) == (10.2345, 0.31416)
