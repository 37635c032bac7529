"""Prompt logprobs: `echo` + `logprobs` on /v1/completions (what evaluation harnesses send), `max_tokens: 0`,
and vLLM's `prompt_logprobs`. They come from the prefill pass itself and equal the model's own log_softmax over
the prompt, however the prefill is chunked."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

COMPLETIONS = "/v1/completions"
PROMPT = "The capital of France is Paris, and the capital of Italy is Rome."


def reference_logprobs(lm, ids: list[int]) -> torch.Tensor:
    """log p(token i | tokens < i) for i >= 1, from one plain forward pass over the whole prompt."""
    with torch.inference_mode():
        logits = lm.model(torch.tensor([ids])).logits[0].float()  # [T, vocab]
    return logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def encode(lm, text: str) -> list[int]:
    return lm.tokenizer.encode(text, add_special_tokens=False)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(make_tiny_server, tiny_lm):
    server = make_tiny_server(prefill_tokens_per_step=16)  # several prefill chunks, each scored in its own pass
    ids = encode(tiny_lm, PROMPT)
    assert len(ids) > 16
    r = httpx.post(server.url + COMPLETIONS, json={"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 2,
                                                   "max_tokens": 0, "temperature": 0}).json()
    choice = r["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                          "prompt_tokens_details": {"cached_tokens": 0}}
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    expected = reference_logprobs(tiny_lm, ids)
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:]), expected, atol=1e-4)
    for token_lp, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        # keyed by token text, as OpenAI's legacy shape is: two byte-pieces that both decode to "�" share a key
        assert 1 <= len(top) <= 2 and max(top.values()) >= token_lp - 1e-6


def test_echo_puts_the_prompt_before_the_answer_and_its_logprobs_first(make_tiny_server, tiny_lm):
    server = make_tiny_server()
    ids = encode(tiny_lm, PROMPT)
    body = {"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(server.url + COMPLETIONS, json=body).json()
    plain = httpx.post(server.url + COMPLETIONS, json=body | {"echo": False}).json()
    choice = r["choices"][0]
    assert choice["text"] == PROMPT + plain["choices"][0]["text"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3 and r["usage"]["completion_tokens"] == 3
    # the plain request reused the echoed one's prefix from the cache: the same tokens, rounding apart
    assert lp["tokens"][len(ids):] == plain["choices"][0]["logprobs"]["tokens"]
    assert lp["token_logprobs"][len(ids):] == pytest.approx(plain["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:len(ids)]), reference_logprobs(tiny_lm, ids), atol=1e-4)


def test_token_id_prompts_are_scored_as_sent(make_tiny_server, tiny_lm):
    # lm-evaluation-harness sends token ids, in a list of one prompt, with max_tokens 1, and drops the last entry
    server = make_tiny_server()
    ids = encode(tiny_lm, "one two three four five six")
    r = httpx.post(server.url + COMPLETIONS, json={"model": "tiny", "prompt": [ids], "echo": True, "logprobs": 1,
                                                   "max_tokens": 1, "temperature": 0}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:len(ids)]), reference_logprobs(tiny_lm, ids), atol=1e-4)


def test_streamed_echo_sends_the_prompt_first_then_the_answer(make_tiny_server, tiny_lm):
    server = make_tiny_server()
    ids = encode(tiny_lm, PROMPT)
    body = {"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    whole = httpx.post(server.url + COMPLETIONS, json=body).json()["choices"][0]
    chunks = []
    with httpx.stream("POST", server.url + COMPLETIONS, json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == whole["logprobs"]["tokens"] and len(tokens) == len(ids) + 4


def test_streamed_score_only_sends_the_prompt_and_no_answer(make_tiny_server):
    server = make_tiny_server()
    body = {"model": "tiny", "prompt": PROMPT, "echo": True, "max_tokens": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + COMPLETIONS, json=body) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == PROMPT
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_vllm_prompt_logprobs_on_completions_and_chat(make_tiny_server, tiny_lm):
    server = make_tiny_server()
    ids = encode(tiny_lm, PROMPT)
    r = httpx.post(server.url + COMPLETIONS, json={"model": "tiny", "prompt": PROMPT, "prompt_logprobs": 3,
                                                   "max_tokens": 2}).json()
    scored = r["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    expected = reference_logprobs(tiny_lm, ids)
    for i, entry in enumerate(scored[1:], start=1):
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(float(expected[i - 1]), abs=1e-4) and own["rank"] >= 1
        # the three most likely tokens, ranked 1-3, and the prompt's own token (one of them, or a fourth)
        assert len(entry) == (3 if own["rank"] <= 3 else 4)
        assert sorted(e["rank"] for e in entry.values())[:3] == [1, 2, 3]
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0, "max_tokens": 1}).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_a_scored_prompt_does_not_reuse_the_prefix_cache(make_tiny_server, tiny_lm):
    # cached positions have no logits: a scored prompt is prefilled whole, and its logprobs are the same again
    server = make_tiny_server()
    body = {"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 0}
    first = httpx.post(server.url + COMPLETIONS, json=body).json()
    again = httpx.post(server.url + COMPLETIONS, json=body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["logprobs"]["token_logprobs"] == first["choices"][0]["logprobs"]["token_logprobs"]


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0, "echo": False}, "max_tokens"),  # nothing asked for: neither echo nor prompt logprobs
    ({"max_tokens": 0, "echo": True, "n": 2}, "n"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": [[1, 2], [3, 4]]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": []}, "prompt"),
])
def test_bad_scoring_requests_get_a_400_naming_the_field(make_tiny_server, body, param):
    server = make_tiny_server()
    r = httpx.post(server.url + COMPLETIONS, json={"model": "tiny", "prompt": PROMPT, "echo": True} | body)
    assert r.status_code == 400, r.text
    assert param in (r.json()["error"]["param"] or "") + r.json()["error"]["message"]


def test_prompts_too_long_to_score_get_a_400(tiny_lm, monkeypatch):
    from app.core import sequence
    from app.core.sampling import SamplingParams
    from app.errors import InvalidRequest

    monkeypatch.setattr(sequence, "MAX_PROMPT_LOGPROBS_TOKENS", 8)
    with pytest.raises(InvalidRequest) as err:
        sequence.check_request(list(range(9)), SamplingParams(prompt_logprobs=1), 400, 256)
    assert err.value.param == "prompt_logprobs" and "8 tokens" in err.value.message


def streamed(server, path: str, body: dict) -> list:
    with httpx.stream("POST", server.url + path, json=body | {"stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) if line[6:].startswith("{") else line[6:]
                for line in r.iter_lines() if line.startswith("data: ")]


def test_streamed_echo_text_offsets_run_on_across_chunks_as_in_the_whole_answer(make_tiny_server):
    # issue 45, finding 9: every chunk after the first restarted text_offset at 0
    server = make_tiny_server()
    body = {"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 5, "temperature": 0,
            "ignore_eos": True}
    whole = httpx.post(server.url + COMPLETIONS, json=body).json()["choices"][0]["logprobs"]
    chunks = [c for c in streamed(server, COMPLETIONS, body)[:-1] if c["choices"]]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["text_offset"] and len(chunks) > 2


def test_n_choices_share_one_scoring_of_the_prompt_and_keep_their_answers(make_tiny_server, tiny_lm, monkeypatch):
    # issue 45, finding 2: each of the n choices scored the whole prompt again in the engine
    from app.core import sequence

    scored_rows = []
    real = sequence.score_tokens
    monkeypatch.setattr(sequence, "score_tokens",
                        lambda logits, *a: scored_rows.append(len(logits)) or real(logits, *a))
    server = make_tiny_server()
    ids = encode(tiny_lm, PROMPT)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "n": 3, "seed": 7, "ignore_eos": True}
    r = httpx.post(server.url + COMPLETIONS, json=body | {"echo": True, "logprobs": 2, "prompt_logprobs": 2}).json()
    assert sum(scored_rows) == len(ids) - 1  # once, whatever n
    plain = httpx.post(server.url + COMPLETIONS, json=body).json()
    for scored, alone in zip(r["choices"], plain["choices"]):
        assert scored["text"] == PROMPT + alone["text"]  # each choice's answer as without scoring
        assert scored["prompt_logprobs"] == r["choices"][0]["prompt_logprobs"]
        first = r["choices"][0]["logprobs"]
        assert scored["logprobs"]["token_logprobs"][:len(ids)] == first["token_logprobs"][:len(ids)]
    assert torch.allclose(torch.tensor(r["choices"][2]["logprobs"]["token_logprobs"][1:len(ids)]),
                          reference_logprobs(tiny_lm, ids), atol=1e-4)
    chunks = [c for c in streamed(server, COMPLETIONS, body | {"echo": True, "logprobs": 2, "prompt_logprobs": 2})
              if isinstance(c, dict)]
    firsts = {}
    for c in chunks:
        for ch in c["choices"]:
            firsts.setdefault(ch["index"], ch)
    assert sorted(firsts) == [0, 1, 2]
    assert all(f["prompt_logprobs"] == r["choices"][0]["prompt_logprobs"] and f["text"].startswith(PROMPT)
               for f in firsts.values())


def test_prompt_logprob_entries_past_their_bound_get_a_400_naming_the_setting(make_tiny_server, tiny_lm):
    ids = encode(tiny_lm, PROMPT)
    server = make_tiny_server(max_prompt_logprob_entries=len(ids) * 3 * 2 - 1)  # tokens x (top 2 + own) x n 2
    body = {"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 1, "n": 2}
    r = httpx.post(server.url + COMPLETIONS, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "logprobs" and "MAX_PROMPT_LOGPROB_ENTRIES" in error["message"]
    assert httpx.post(server.url + COMPLETIONS, json=body | {"n": 1}).status_code == 200
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": PROMPT * 2}], "prompt_logprobs": 20, "max_tokens": 1})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "prompt_logprobs"


@pytest.fixture
def slow_steps(monkeypatch):
    import time

    import app.core.engine.step as step_module

    real = step_module.run_pass
    monkeypatch.setattr(step_module, "run_pass", lambda *a, **k: (time.sleep(0.05), real(*a, **k))[1])


@pytest.mark.full
@pytest.mark.parametrize("stream", [False, True])
def test_a_deadline_during_a_scored_prefill_gives_an_empty_answer_not_a_wrong_score(make_tiny_server, slow_steps,
                                                                                     stream):
    # issue 45, finding 9: the whole prompt came back as `text` with one logprob entry and prompt_logprobs [null]
    server = make_tiny_server(prefill_tokens_per_step=16)  # ~9 passes of 50 ms before the prompt is scored
    body = {"model": "tiny", "prompt": PROMPT * 5, "echo": True, "logprobs": 1, "prompt_logprobs": 1, "max_tokens": 0}
    headers = {"x-request-timeout": "0.2"}
    if stream:
        with httpx.stream("POST", server.url + COMPLETIONS, json=body | {"stream": True}, headers=headers) as r:
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        choices = [c for line in lines[:-1] for c in json.loads(line)["choices"]]
        assert "".join(c["text"] for c in choices) == ""
        choice = choices[-1]
    else:
        r = httpx.post(server.url + COMPLETIONS, json=body, headers=headers)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == "" and r.json()["usage"]["completion_tokens"] == 0
    # as any answer cut before its first token: nothing made, and no score that looks like one
    assert choice["finish_reason"] == "timeout"
    assert choice["logprobs"] is None and choice["prompt_logprobs"] is None


def test_json_written_in_pieces_is_the_json_of_the_whole():
    from app.openai.scoring import JSON_PIECE, json_text

    body = {"id": "x", "choices": [{"index": i, "text": "é\n\"", "logprobs": {
        "tokens": [f"t{j}" for j in range(3 * JSON_PIECE + 5)], "top_logprobs": [None, {"a": -1.5}] * JSON_PIECE},
        "prompt_logprobs": [None] + [{"7": {"logprob": -0.25, "rank": 1}}] * (JSON_PIECE + 1)} for i in range(2)],
        "empty": [], "usage": {"prompt_tokens": 3}}
    assert json_text(body) == json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    assert json_text(body, depth=0) == json_text(body)
