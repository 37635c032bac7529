"""`python -m benchmarks invariance` on the tiny model: through a server, the fp32 oracle's tokens hold alone and
amid others and the report counts them; at op level, the finder names the very module whose rows depend on the
pass's other rows."""

from __future__ import annotations

import json

import pytest
import torch

from app.models.cpu import auto_dtype
from benchmarks import invariance_ops
from benchmarks.__main__ import main


@pytest.mark.server
def test_a_server_run_compares_every_answer_with_the_first_alone_one_and_fp32_tokens_hold(tiny_dir, tmp_path,
                                                                                          capsys):
    out = tmp_path / "invariance.json"
    assert main(["invariance", "--model", str(tiny_dir), "--prompt-lens", "3,40", "--rounds", "2", "--max-tokens",
                 "6", "--env", "SPECULATIVE=off", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["bench"] == "invariance" and report["machine"]["cpu"] and report["prompt_lens"] == [3, 40]
    run = report["runs"]["SPECULATIVE=off"]
    assert run["env"] == {"SPECULATIVE": "off"} and len(run["prompts"]) == 2
    for prompt in run["prompts"]:
        assert set(prompt["answers"]) == {"alone 1", "together 1", "alone 2", "together 2"}
        assert set(prompt["compared"]) == {"together 1", "together 2", "alone 2"}
        answers = list(prompt["answers"].values())
        assert all(len(a["tokens"]) == len(a["logprobs"]) == 6 for a in answers)
        # fp32 greedy: the oracle's tokens, alone or amid the other request, cold or warm prefix cache
        assert all(a["tokens"] == answers[0]["tokens"] for a in answers)
        assert all(d["first_token_diff"] is None for d in prompt["compared"].values())
        for d in prompt["compared"].values():  # identical means no logprob differs either
            assert d["identical"] == (d["first_logprob_diff"] is None)
    assert run["prompts"][1]["prompt_tokens"] > run["prompts"][0]["prompt_tokens"]
    counts = run["summary"]
    assert counts["amid_others"]["n"] == 4 and counts["alone_again"]["n"] == 2
    assert counts["amid_others"]["tokens_identical"] == 4 and counts["alone_again"]["tokens_identical"] == 2
    from benchmarks import run_tables

    row = next(line for line in run_tables.invariance_table([(out.name, report)]).splitlines() if "SPECULATIVE" in line)
    assert row.split(" | ")[3] == "4 of 4" and "2 prompts of 3 to 40 tokens" in row  # tokens amid others
    printed = capsys.readouterr().out
    assert "first differing token" in printed and "amid others:" in printed
    assert "of 4 identical, token for token and logprob for logprob" in printed
    from benchmarks.invariance import keep_first_answers  # --keep-answers first: what a docs/results file keeps

    kept = keep_first_answers(json.loads(out.read_text()))["runs"]["SPECULATIVE=off"]
    assert kept["summary"] == counts and all(set(p["answers"]) == {"alone 1"} for p in kept["prompts"])
    assert [p["answers"]["alone 1"] for p in kept["prompts"]] == [p["answers"]["alone 1"] for p in run["prompts"]]


def test_the_op_finder_names_the_module_whose_rows_depend_on_the_others(tiny_dir, tmp_path, capsys):
    """q_proj of layer 0 made to add its call's row count: the first op whose rows differ alone and packed, at the
    prefill, by exactly the other prompts' tokens x 1/1024 (in fp32: bf16, the default on a CPU with native bf16,
    would round the sum). Nothing before it differs."""
    lm = invariance_ops.load(tiny_dir, {"BATCH_INVARIANT": "off", "DTYPE": "float32"})
    q_proj = lm.model.model.layers[0].self_attn.q_proj
    q_proj.register_forward_hook(lambda module, inputs, output: output + inputs[0].shape[-2] / 1024)
    prompts = ["Hi", "Which city is the capital of France?", "Tell me a long story about a café in Paris."]
    found = invariance_ops.measure_model(lm, prompts, steps=4)
    ids = [lm.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    for target, r in enumerate(found["ops"]):
        others = sum(len(p) for p in ids) - len(ids[target])
        assert (r["step"], r["module"], r["layer"], r["call"]) == (0, "model.layers.0.self_attn.q_proj", 0, 0)
        assert r["shape"] == [1, len(ids[target]), 64] and r["logits_max_diff"] > 0
        assert r["max_diff"] == pytest.approx(others / 1024, rel=1e-3)
        assert r["modules_differing"] >= 1 and r["modules_compared"] > 10


def test_the_op_level_command_reports_each_prompt_and_finds_nothing_where_nothing_differs(tiny_dir, tmp_path,
                                                                                           capsys):
    out = tmp_path / "ops.json"
    assert main(["invariance", "--ops", "--model", str(tiny_dir), "--prompt-lens", "3,40", "--max-tokens", "3",
                 "--compare", "BATCH_INVARIANT=off,on", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["runs"]) == ["BATCH_INVARIANT=off", "BATCH_INVARIANT=on"]
    assert [run["batch_invariant"] for run in report["runs"].values()] == [False, True]
    for run in report["runs"].values():
        assert run["dtype"] == str(auto_dtype(torch.device("cpu"))[0]).removeprefix("torch.") and len(run["ops"]) == 2
        for r in run["ops"]:
            assert r["step"] is None or ("module" in r) or r["logits_max_diff"] > 0
            if r["step"] is None:  # nothing differed: every step ran, the logits equal too
                assert r["logits_max_diff"] == 0.0
    printed = capsys.readouterr().out
    assert "first module that differs" in printed and "prompts: every module's rows bit-identical" in printed


def test_the_finder_takes_a_prefill_row_along_the_token_axis_and_lm_heads_along_the_requests():
    hidden = torch.arange(2 * 10 * 3, dtype=torch.float32).reshape(2, 10, 3)[:1]  # [1, 10 tokens, 3]
    assert invariance_ops.target_rows(hidden, tokens=10, target=4, requests=3).shape == (1, 4, 3)
    logits = torch.zeros(1, 3, 7)  # lm_head on the last position of each of 3 requests
    assert invariance_ops.target_rows(logits, tokens=10, target=4, requests=3).shape == (1, 1, 7)
    assert invariance_ops.target_rows((torch.zeros(5, 5), None), tokens=10, target=4, requests=3) is None
    assert invariance_ops.layer_of("model.layers.12.mlp.down_proj") == 12 and invariance_ops.layer_of("lm_head") is None


def test_the_prompts_have_the_asked_lengths_and_each_starts_otherwise(tiny_tokenizer):
    from benchmarks.invariance import build_prompts

    prompts = build_prompts(tiny_tokenizer, [3, 40, 300, 40])
    counts = [len(tiny_tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
    assert all(n - 3 <= count <= n for count, n in zip(counts, [3, 40, 300, 40])), counts  # a character: 3 bytes
    assert prompts[1] != prompts[3] and build_prompts(tiny_tokenizer, [3, 40, 300, 40]) == prompts


def test_bad_settings_are_named():
    with pytest.raises(SystemExit, match="--compare: NOT_A_SETTING is not a setting"):
        main(["invariance", "--compare", "NOT_A_SETTING=a,b"])
    with pytest.raises(SystemExit, match="--env: expected NAME=VALUE"):
        main(["invariance", "--env", "QUANT"])


def test_kernel_probe_tells_a_row_invariant_kernel_from_one_that_sees_its_neighbours():
    """`--kernels` rests on `differing_rows`: a kernel whose row depends on the call's other rows is named at
    every row count past one; a row-by-row one never is (whatever this CPU's own kernels do)."""
    import torch

    from benchmarks import invariance_kernels

    x = torch.randn(max(invariance_kernels.ROWS), 8)
    sees_neighbours = lambda rows: rows * 2 + rows.mean()  # noqa: E731 - every row shifted by the call's mean
    assert invariance_kernels.differing_rows(sees_neighbours, x) == list(invariance_kernels.ROWS[1:])
    assert invariance_kernels.differing_rows(lambda rows: rows * 2 + 1, x) == []


def test_the_docs_table_says_whether_a_second_setting_changed_the_first_alone_answers():
    """Speculation on against off must not change an answer: the table counts, from the answers the file keeps,
    how many prompts' first alone answers are the first setting's, whole and token for token."""
    from benchmarks import run_tables

    def answer(logprob: float) -> dict:
        return {"answers": {"alone 1": {"tokens": [["a", [97]]], "logprobs": [logprob]}}, "compared": {}}

    report = {"model": "/m/qwen", "prompt_lens": [3, 40], "settings": {"rounds": 1, "max_tokens": 1, "env": []},
              "runs": {"SPECULATIVE=ngram": {"prompts": [answer(-0.5), answer(-0.25)]},
                       "SPECULATIVE=off": {"prompts": [answer(-0.5), answer(-0.125)]}}}
    assert ("Each prompt's first alone answer with SPECULATIVE=off against SPECULATIVE=ngram (qwen): 1 of 2 "
            "identical token for token and logprob for logprob, 2 of 2 token for token.") in \
        run_tables.invariance_table([("inv.json", report)])
