"""Prompt logprobs on the real models, over HTTP: in fp32 they equal log_softmax of the model's own forward pass
over the prompt, and lm-evaluation-harness's `local-completions` model scores a small task through us with the
model's own loglikelihoods (its data: tests/real/data/capitals.jsonl; nothing is fetched)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from app.config import Settings
from app.main import create_app
from app.models.fetch import fetch_model
from conftest import MODEL_CACHE, ThreadServer

pytestmark = [pytest.mark.real_model, pytest.mark.server]
DATA = Path(__file__).parent / "data" / "capitals.jsonl"
TEXT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
        "The quick brown fox jumps over the lazy dog. 北京是中国的首都。")


def own_logprobs(lm, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from one forward pass of the model itself."""
    with torch.inference_mode():
        logits = lm.model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.parametrize("fixture, name", [("qwen_fp32", "qwen2.5-coder-0.5b-instruct"),
                                           ("smollm_fp32", "smollm2-135m-instruct")])
def test_echoed_prompt_logprobs_equal_the_models_own_log_softmax(request, fixture, name):
    lm = request.getfixturevalue(fixture)
    ids = lm.tokenizer.encode(TEXT, add_special_tokens=False)
    with ThreadServer(create_app(Settings(model=name, prefill_tokens_per_step=32), lm=lm)) as server:
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": name, "prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 0}).json()
    lp = r["choices"][0]["logprobs"]
    assert r["choices"][0]["text"] == TEXT and len(lp["token_logprobs"]) == len(ids) > 32  # scored in chunks
    served = torch.tensor(lp["token_logprobs"][1:])
    gap = (served - own_logprobs(lm, ids)).abs().max().item()
    print(f"\n[{name}] {len(ids)} prompt tokens, largest |served - own| logprob gap {gap:.2e}")
    assert gap <= 1e-4


def test_lm_evaluation_harness_scores_a_task_through_us(smollm_fp32, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name = "smollm2-135m-instruct"
    (tmp_path / "capitals.yaml").write_text(
        "task: capitals_offline\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {DATA}\ntest_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{{{question}}}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    tokenizer_dir = fetch_model(name, MODEL_CACHE)  # the converted model's directory: its tokenizer files
    with ThreadServer(create_app(Settings(model=name), lm=smollm_fp32)) as server:
        results = lm_eval.simple_evaluate(
            model="local-completions", tasks=["capitals_offline"], log_samples=True,
            task_manager=TaskManager(include_path=str(tmp_path)),
            model_args=f"model={name},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                       f"tokenizer={tokenizer_dir},num_concurrent=1,max_retries=1,tokenized_requests=True")
    samples = results["samples"]["capitals_offline"]
    assert len(samples) == 6 and all(len(s["resps"]) == 3 for s in samples)
    tok = smollm_fp32.tokenizer
    for sample in samples:
        for (context, continuation), ((served, _greedy),) in zip(sample["arguments"], sample["resps"]):
            # the harness's own split: the continuation's tokens are what the whole adds to the context's
            context_ids = tok.encode(context, add_special_tokens=False)
            whole = tok.encode(context + continuation, add_special_tokens=False)
            own = own_logprobs(smollm_fp32, whole)[len(context_ids) - 1:].sum().item()
            assert served == pytest.approx(own, abs=1e-3), (context, continuation)
    print(f"\n[lm-eval] capitals_offline acc {results['results']['capitals_offline']['acc,none']:.2f}")
