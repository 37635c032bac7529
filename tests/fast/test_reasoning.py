"""Reasoning models (Qwen3): the qwen3 architecture, the split of thinking from answer, and the thinking budget.

A random model cannot be asked to think, so the end-to-end tests use a tiny Qwen3 whose greedy output is a chosen
token chain: its layers add nothing (zeroed output projections), so the next token depends only on the current
one, and lm_head is set to map each token of the chain to the next. Its tokenizer has `<think>` and `</think>` as
added, non-special tokens, as Qwen3's has, and its chat template is written in Qwen3's format.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from conftest import ThreadServer, build_tiny_tokenizer
from tokenizers import AddedToken

from app.config import Settings
from app.core.generate import generate
from app.core.preamble import Preamble, PreambleState
from app.core.sampling import SamplingParams
from app.models.loading import LoadedModel, load_model
from app.openai.reasoning import reasoning_format
from app.openai.reasoning.qwen3 import OPEN, CLOSE, splitter as qwen3_splitter

# Qwen3's chat format: tools in the system turn, thinking kept only for answers after the last user turn, and an
# empty think block after the generation prompt when enable_thinking is false.
QWEN3_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(last_user=0) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content and loop.index0 > ns.last_user %}"
    "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{- call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


def qwen3_tokenizer():
    tokenizer = build_tiny_tokenizer()
    # As in Qwen3: added tokens, but not special ones, so decoding keeps them and the splitter must take them out.
    tokenizer.add_tokens([AddedToken(text, special=False, normalized=False)
                          for text in ("<think>", "</think>", "<tool_call>", "</tool_call>")])
    # Not Qwen3's: a whole call as one token, so that a token chain can write it (see scripted_lm)
    tokenizer.add_tokens([AddedToken(CALL, special=False, normalized=False)])
    tokenizer.chat_template = QWEN3_TEMPLATE
    return tokenizer


def tiny_qwen3(vocab_size: int, num_layers: int = 2, seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # sharper logits: no greedy ties
    return model.eval()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def one_id(tokenizer, text: str) -> int:
    (token,) = ids(tokenizer, text)
    return token


def scripted_lm(tokenizer, chain: list[str]) -> LoadedModel:
    """A tiny Qwen3 whose greedy answer follows `chain`: each text (one token) is followed by the next."""
    model = tiny_qwen3(len(tokenizer), num_layers=1)
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()  # the layer adds nothing: the hidden state is the token's embedding
        layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        normed = embed / embed.pow(2).mean(-1, keepdim=True).add(model.config.rms_norm_eps).sqrt()  # the final norm
        model.lm_head.weight.zero_()
        for current, following in zip(chain, chain[1:]):
            model.lm_head.weight[one_id(tokenizer, following)] += normed[one_id(tokenizer, current)]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return LoadedModel(model=model, tokenizer=tokenizer, name="qwen3-tiny", max_context=1024, eos_ids=(im_end,))


# The prompt ends with "assistant\n"; the model thinks "The Paris is", then answers "Paris". With thinking off the
# prompt ends with "</think>\n\n", from where the same chain gives the answer at once.
THINKS = ["\n", "<think>", "The", " Paris", " is", "</think>", "\n\n", "Par", "is", "<|im_end|>"]
# This one never stops thinking: " is" leads back to "The".
THINKS_FOREVER = ["\n", "<think>", "The", " Paris", " is", "The"] + ["\n\n", "Par", "is", "<|im_end|>"]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
# Thinks, then calls a tool in Qwen's Hermes format; or writes a call while thinking, which is no call.
THINKS_THEN_CALLS = ["\n", "<think>", "The", " Paris", " is", "</think>", "\n\n", "<tool_call>", CALL, "</tool_call>",
                     "<|im_end|>"]
CALLS_WHILE_THINKING = ["\n", "<think>", "<tool_call>", CALL, "</tool_call>", "</think>", "\n\n", "Par", "is",
                        "<|im_end|>"]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tokenizer():
    return qwen3_tokenizer()


@pytest.fixture(scope="module")
def thinker(tokenizer):
    with ThreadServer(_app(scripted_lm(tokenizer, THINKS))) as server:
        yield server


@pytest.fixture(scope="module")
def overthinker(tokenizer):
    with ThreadServer(_app(scripted_lm(tokenizer, THINKS_FOREVER))) as server:
        yield server


def _app(lm: LoadedModel):
    from app.main import create_app

    return create_app(Settings(model="qwen3-tiny"), lm=lm)


def chat(server, stream: bool = False, **extra) -> dict | list:
    body = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "Which city is the capital of France?"}],
            "temperature": 0, "max_tokens": 20, "stream": stream, **extra}
    if not stream:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def joined(chunks: list[dict], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


# ---- the qwen3 architecture ----

def test_qwen3_loads_and_decodes_like_generate(tmp_path, tokenizer):
    """A saved Qwen3 directory loads through load_model, and our loop gives model.generate()'s greedy tokens."""
    tiny_qwen3(len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), device="cpu", dtype="float32")
    assert lm.model.config.model_type == "qwen3" and reasoning_format(lm.tokenizer) is not None
    prompt = lm.encode_chat([{"role": "user", "content": "Paris is a city"}])
    greedy = SamplingParams(max_tokens=24, do_sample=False, ignore_eos=True)
    ours = [e.token_id for e in generate(lm.model, lm.tokenizer, prompt, greedy, (), 256)]
    theirs = lm.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
    assert ours == theirs[0, len(prompt):].tolist()


def test_qwen3_serves_batched_like_alone(tokenizer):
    """Several requests in one packed step give each one's solo greedy tokens (qwen3 has q/k norms per head)."""
    model = tiny_qwen3(len(tokenizer))
    lm = LoadedModel(model=model, tokenizer=tokenizer, name="qwen3-tiny", max_context=256, eos_ids=())
    prompts = [ids(tokenizer, text) for text in ("The capital of France", "def reverse(s):", "北京是中国的首都")]
    params = SamplingParams(max_tokens=10, do_sample=False)
    solo = [[e.token_id for e in generate(model, tokenizer, p, params, (), 256)] for p in prompts]
    with ThreadServer(_app(lm)) as server, ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: httpx.post(server.url + "/v1/completions", timeout=30, json={
            "model": "qwen3-tiny", "prompt": tokenizer.decode(p), "max_tokens": 10, "temperature": 0}), prompts))
    assert [a.json()["usage"]["completion_tokens"] for a in answers] == [10, 10, 10]
    assert [a.json()["choices"][0]["text"] for a in answers] == [tokenizer.decode(s) for s in solo]


# ---- the split, end to end ----

def test_thinking_is_split_from_the_answer(thinker):
    message = chat(thinker)["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == "The Paris is"
    assert message["content"] == "Paris"


def test_streamed_thinking_comes_first_and_joins_up(thinker):
    full = chat(thinker)["choices"][0]["message"]
    chunks = chat(thinker, stream=True)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    kinds = [("r" if d.get("reasoning_content") else "") + ("c" if d.get("content") else "") for d in deltas]
    kinds = [k for k in kinds if k]
    assert kinds == sorted(kinds, key=lambda k: k != "r") and "c" in kinds and "r" in kinds, kinds
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert joined(chunks, "reasoning_content") == full["reasoning_content"]
    assert joined(chunks, "content") == full["content"]
    assert not any("think>" in json.dumps(d) for d in deltas), "the tags never appear"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_thinking_off_is_all_content(thinker):
    message = chat(thinker, chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    assert message["content"] == "Paris" and message["reasoning_content"] is None
    effort_none = chat(thinker, reasoning_effort="none")["choices"][0]["message"]
    assert effort_none == message


def test_cut_off_while_thinking_is_reasoning_with_length(thinker):
    for stream in (False, True):
        answer = chat(thinker, stream=stream, max_tokens=3)
        if stream:
            assert answer[-1]["choices"][0]["finish_reason"] == "length"
            assert joined(answer, "reasoning_content") == "The Paris" and joined(answer, "content") == ""
        else:
            choice = answer["choices"][0]
            assert choice["finish_reason"] == "length"
            assert choice["message"]["reasoning_content"] == "The Paris" and choice["message"]["content"] is None


def test_openai_sdk_reads_reasoning(thinker):
    client = openai.OpenAI(base_url=thinker.url + "/v1", api_key="unused")
    message = client.chat.completions.create(model="qwen3-tiny", temperature=0, max_tokens=20, messages=[
        {"role": "user", "content": "hi"}]).choices[0].message
    assert message.content == "Paris" and message.model_extra["reasoning_content"] == "The Paris is"


def test_earlier_thinking_reaches_the_template(tokenizer):
    """Assistant turns may carry their thinking back (either name); the template decides what to keep."""
    from app.openai.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(model="m", messages=[
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning": "thought"}])
    rendered = tokenizer.apply_chat_template(body.chat_messages(), tokenize=False)
    assert "<think>\nthought\n</think>\n\nb" in rendered


def test_tool_calls_only_after_the_thinking(tokenizer):
    with ThreadServer(_app(scripted_lm(tokenizer, THINKS_THEN_CALLS))) as server:
        choice = chat(server, tools=[WEATHER_TOOL])["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        message = choice["message"]
        assert message["reasoning_content"] == "The Paris is" and message["content"] is None
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        streamed = chat(server, stream=True, tools=[WEATHER_TOOL])
        assert joined(streamed, "reasoning") == "The Paris is"
        calls = [d for c in streamed for d in c["choices"][0]["delta"].get("tool_calls") or []]
        assert calls[0]["function"]["name"] == "get_weather"
        assert json.loads("".join(d["function"]["arguments"] for d in calls)) == {"city": "Paris"}
    with ThreadServer(_app(scripted_lm(tokenizer, CALLS_WHILE_THINKING))) as server:
        choice = chat(server, tools=[WEATHER_TOOL])["choices"][0]
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        assert choice["message"]["content"] == "Paris" and "get_weather" in choice["message"]["reasoning_content"]


CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}}, "required": ["city"],
               "additionalProperties": False}


@pytest.mark.full
def test_grammar_applies_only_after_the_thinking(thinker, overthinker):
    """A json_schema answer: the thinking stays free text (a grammar over it would forbid "<think>" itself), the
    answer after </think> matches the schema; also when the budget forced the </think>."""
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}
    for server, extra in ((thinker, {}), (overthinker, {"max_reasoning_tokens": 4})):
        message = chat(server, max_tokens=60, response_format=fmt, **extra)["choices"][0]["message"]
        assert message["reasoning_content"] == "The Paris is"
        assert json.loads(message["content"]) == {"city": "Paris"}


# ---- the thinking budget ----

def test_budget_closes_the_thinking_and_the_answer_follows(overthinker):
    never_ends = chat(overthinker, max_tokens=30)["choices"][0]
    assert never_ends["finish_reason"] == "length" and never_ends["message"]["content"] is None
    capped = chat(overthinker, max_reasoning_tokens=4, max_tokens=30)
    choice = capped["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "Paris", "reasoning_content": "The Paris is",
                                 "reasoning": "The Paris is"}
    # <think> The Paris is (4, the budget), then the forced </think> \n\n, then Par is <|im_end|>
    assert capped["usage"]["completion_tokens"] == 9
    streamed = chat(overthinker, stream=True, max_reasoning_tokens=4, max_tokens=30)
    assert joined(streamed, "reasoning") == "The Paris is" and joined(streamed, "content") == "Paris"


def test_reasoning_effort_maps_to_a_budget(overthinker):
    from app.openai.reasoning import EFFORT_BUDGETS

    low = chat(overthinker, reasoning_effort="low", max_tokens=EFFORT_BUDGETS["low"] + 10)["choices"][0]
    assert low["finish_reason"] == "stop" and low["message"]["content"] == "Paris"
    assert len(low["message"]["reasoning_content"]) > 1000
    minimal = chat(overthinker, reasoning_effort="minimal")["choices"][0]["message"]
    assert minimal["reasoning_content"] is None and minimal["content"] == "Paris"


def test_bad_reasoning_fields_get_400(thinker, make_tiny_server):
    for extra, param in (({"reasoning_effort": "extreme"}, "reasoning_effort"),
                         ({"max_reasoning_tokens": -1}, "max_reasoning_tokens"),
                         ({"chat_template_kwargs": {"add_generation_prompt": False}},
                          "chat_template_kwargs.add_generation_prompt")):
        r = httpx.post(thinker.url + "/v1/chat/completions", json={
            "model": "qwen3-tiny", "messages": [{"role": "user", "content": "hi"}], **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    plain = make_tiny_server()  # a model that does not think
    r = httpx.post(plain.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_reasoning_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_reasoning_tokens"
    plain_answer = httpx.post(plain.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).json()
    assert "reasoning_content" not in plain_answer["choices"][0]["message"], "no reasoning fields for such models"


# ---- the parts alone ----

def test_preamble_forces_its_end_once_the_budget_is_spent():
    state = PreambleState(Preamble(end_ids=(7,), budget=2, forced_ids=(7, 8)))
    seen = []
    for n, model_wants in enumerate([1, 2, 3, 4, 5], start=1):
        token = state.forced_token() or model_wants
        seen.append(token)
        state.observe(token, n)
    assert seen == [1, 2, 7, 8, 5] and state.ended
    natural = PreambleState(Preamble(end_ids=(7,), budget=3, forced_ids=(7, 8)))
    for n, token in enumerate([1, 7, 2, 3, 4], start=1):
        assert natural.forced_token() is None
        natural.observe(token, n)
    assert natural.ended, "an end marker the model wrote itself switches the budget off"
    assert PreambleState(Preamble(end_ids=(7,), budget=0, forced_ids=(7,))).forced_token() == 7
    with pytest.raises(ValueError):
        Preamble(end_ids=(7,), budget=1, forced_ids=(8,))


def test_budget_in_the_decode_loop(tokenizer):
    lm = scripted_lm(tokenizer, THINKS_FOREVER)
    end = reasoning_format(tokenizer)
    prompt = lm.encode_chat([{"role": "user", "content": "hi"}])
    params = SamplingParams(max_tokens=12, do_sample=False, preamble=end.preamble(budget=3))
    text = "".join(e.text for e in generate(lm.model, tokenizer, prompt, params, lm.eos_ids, 256))
    assert text == "<think>The Paris</think>\n\nParis"


@pytest.mark.parametrize("pieces", [
    ["<think>\nI think.\n</think>\n\nAnswer."],
    ["<", "think", ">\n", "I ", "think", ".\n", "</", "think", ">", "\n", "\nAns", "wer."],
    ["<think>", "\n", "I think.", "\n", "</think>", "\n\n", "Answer."],
])
def test_splitter_any_split_same_result(pieces):
    splitter = qwen3_splitter((OPEN,), (CLOSE,), True, {})
    parts = [splitter.feed(p) for p in pieces] + [splitter.flush()]
    assert "".join(r for r, _ in parts) == "I think." and "".join(c for _, c in parts) == "Answer."


def test_splitter_rules():
    def split(text: str, thinking: bool = True) -> tuple[str, str]:
        s = qwen3_splitter((OPEN,), (CLOSE,), thinking, {})
        (r1, c1), (r2, c2) = s.feed(text), s.flush()
        return r1 + r2, c1 + c2

    assert split("no tags at all") == ("no tags at all", ""), "thinking on, no end tag: all reasoning"
    assert split("no tags at all", thinking=False) == ("", "no tags at all")
    assert split("the template opened it</think>\n\nok") == ("the template opened it", "ok")
    assert split("<think>\n\n</think>\n\nok") == ("", "ok")
    assert split("<think>a < b and </thought> are text</think>x") == ("a < b and </thought> are text", "x")
    assert split("<think>\nhalf a tag </thi") == ("half a tag </thi", ""), "an unfinished tag is text at the end"
    assert split("<thi") == ("", "")
