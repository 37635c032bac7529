"""Each reasoning format through the three APIs, as their own SDKs read them: chat completions' `reasoning_content`
(openai SDK), the Responses API's reasoning item (openai SDK) and the Messages API's thinking block (anthropic SDK),
whole and streamed; and the thinking budget in each format.

Each family gets a tiny tokenizer with its markers (special tokens where the family's are) and a chat template in
its format, and a scripted model (test_reasoning.scripted_lm: each token leads to the next of a chain) that thinks
"The Paris is" and answers "Paris". A scripted token has one successor, so where a marker comes twice in one answer
(gpt-oss's second header) the test tokenizer writes the second one as two ordinary tokens ("<|chan" "nel|>"): the
splitter reads text, so it takes them for the marker all the same.
"""

from __future__ import annotations

import dataclasses

import openai
import pytest
from conftest import ThreadServer, build_tiny_tokenizer
from test_reasoning import THINKS, THINKS_FOREVER, _app, qwen3_tokenizer, scripted_lm
from tokenizers import AddedToken

from app.openai.protocol import ChatCompletionRequest
from app.openai.reasoning import harmony, reasoning_format

THOUGHT, ANSWER = "The Paris is", "Paris"
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% for m in messages %}{% if m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m.content }}<|end|>{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
R1_TEMPLATE = ("{% for m in messages %}{% if m.role == 'user' %}<|im_start|>{{ m.content }}{% else %}"
               "{% set c = m.content %}{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}"
               "<|im_end|>{{ c }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_end|><think>\n{% endif %}")
MAGISTRAL_TEMPLATE = ("[SYSTEM_PROMPT]Think first, between [THINK] and [/THINK].[/SYSTEM_PROMPT]"
                      "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
                      "{% else %}{{ m.content }}<|im_end|>{% endif %}{% endfor %}")
GRANITE_TEMPLATE = ("{% if thinking %}<|start_of_role|>system<|end_of_role|>Write your thoughts after 'Here is my "
                    "thought process:' and your response after 'Here is my response:'.<|end_of_text|>{% endif %}"
                    "{% for m in messages %}<|start_of_role|>{{ m.role }}<|end_of_role|>{{ m.content }}"
                    "<|end_of_text|>{% endfor %}{% if add_generation_prompt %}<|start_of_role|>assistant"
                    "<|end_of_role|>{% endif %}")
HARMONY_OPEN = ["assistant", "<|channel|>", "analysis", "<|message|>"]
# family: (template, special tokens, ordinary added tokens, the chain, the chain that never stops thinking,
#          what the chain ends with (EOS), the template switch that turns thinking on). A chain that loops has its
#          way out (what follows the forced end marker) first, so that no token has two successors.
FAMILIES = {
    "qwen3": None,  # test_reasoning's
    "deepseek_r1": (R1_TEMPLATE, (), ("<think>", "</think>"), THINKS[:1] + THINKS[2:], THINKS_FOREVER[:1] +
                    THINKS_FOREVER[2:], "<|im_end|>", {}),
    "harmony": (HARMONY_TEMPLATE, harmony.MARKERS, ("assistant", "analysis", "final", "<|chan", "nel|>", "<|mess",
                                                    "age|>"),
                HARMONY_OPEN + ["The", " Paris", " is", "<|end|>", "<|start|>", "<|chan", "nel|>", "final", "<|mess",
                                "age|>", "Par", "is", "<|return|>"],
                HARMONY_OPEN + ["The", " Paris", " is", "The"], "<|return|>", {}),
    "magistral": (MAGISTRAL_TEMPLATE, ("[THINK]", "[/THINK]", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                                       "[/SYSTEM_PROMPT]"), (),
                  ["[/INST]", "[THINK]", "The", " Paris", " is", "[/THINK]", "Par", "is", "<|im_end|>"],
                  ["[/THINK]", "Par", "is", "<|im_end|>", "[/INST]", "[THINK]", "The", " Paris", " is", "The"],
                  "<|im_end|>", {}),
    # "Here is my response:" as one token here; a real Granite writes it in several (the splitter's suite covers it)
    "granite": (GRANITE_TEMPLATE, ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"),
                ("Here is my thought process:", "Here is my response:"),
                ["<|end_of_role|>", "Here is my thought process:", "The", " Paris", " is", "Here is my response:",
                 "Par", "is", "<|end_of_text|>"],
                ["\n", "Par", "is", "<|end_of_text|>", "<|end_of_role|>", "Here is my thought process:", "The",
                 " Paris", " is", "The"], "<|end_of_text|>", {"thinking": True}),
}


def family_tokenizer(name: str):
    if FAMILIES[name] is None:
        return qwen3_tokenizer()
    template, special, added = FAMILIES[name][:3]
    tokenizer = build_tiny_tokenizer()
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tokenizer.chat_template = template
    return tokenizer


def family_lm(name: str, forever: bool = False):
    tokenizer = family_tokenizer(name)
    if FAMILIES[name] is None:
        return scripted_lm(tokenizer, THINKS_FOREVER if forever else THINKS), {}
    chain, chain_forever, eos, switch = FAMILIES[name][3:]
    lm = scripted_lm(tokenizer, chain_forever if forever else chain)
    return dataclasses.replace(lm, eos_ids=(tokenizer.convert_tokens_to_ids(eos),)), switch


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    lm, switch = family_lm(request.param)
    assert reasoning_format(lm.tokenizer).name == request.param, "auto picks the family's format"
    with ThreadServer(_app(lm)) as server:
        yield request.param, server, switch


def ask(switch: dict) -> dict:
    extra = {"chat_template_kwargs": switch} if switch else {}
    return {"model": "qwen3-tiny", "temperature": 0, "max_tokens": 30, "extra_body": extra}


QUESTION = [{"role": "user", "content": "Which city is the capital of France?"}]


def no_markers(name: str, *texts: str) -> bool:
    markers = {"harmony": harmony.MARKERS + ("<|chan", "<|mess")}.get(name, ("<think>", "</think>", "[THINK]",
                                                                             "[/THINK]", "Here is my"))
    return not any(m in t for t in texts for m in markers)


@pytest.mark.full
def test_chat_completions_carry_reasoning_content(family):
    name, server, switch = family
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    message = client.chat.completions.create(messages=QUESTION, **ask(switch)).choices[0].message
    assert message.content == ANSWER
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == THOUGHT
    reasoning, content, last = "", "", None
    for chunk in client.chat.completions.create(messages=QUESTION, stream=True, **ask(switch)):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        last = chunk.choices[0].finish_reason or last
        assert no_markers(name, delta.content or "", (delta.model_extra or {}).get("reasoning_content") or "")
    assert (reasoning, content, last) == (THOUGHT, ANSWER, "stop")


@pytest.mark.full
def test_responses_carry_a_reasoning_item(family):
    name, server, switch = family
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    extra = ask(switch)
    resp = client.responses.create(model=extra["model"], input=QUESTION[0]["content"], temperature=0,
                                   max_output_tokens=30, extra_body=extra["extra_body"])
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == THOUGHT and resp.output_text == ANSWER
    events = list(client.responses.create(model=extra["model"], input=QUESTION[0]["content"], temperature=0,
                                          max_output_tokens=30, stream=True, extra_body=extra["extra_body"]))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, text) == (THOUGHT, ANSWER) and no_markers(name, thought, text)
    assert events[-1].type == "response.completed"


@pytest.mark.full
def test_messages_carry_a_thinking_block(family):
    """Anthropic's `thinking: enabled` also sets the `thinking` template switch (Granite's)."""
    import anthropic  # here: the SDK takes seconds to import, and every worker collects this file

    name, server, _ = family
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    thinking = {"type": "enabled", "budget_tokens": 1024}
    message = client.messages.create(model="qwen3-tiny", max_tokens=30, messages=QUESTION, thinking=thinking,
                                     extra_body={"temperature": 0})
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == THOUGHT and message.content[1].text == ANSWER
    with client.messages.stream(model="qwen3-tiny", max_tokens=30, messages=QUESTION, thinking=thinking,
                                extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    thought = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                      and e.delta.type == "thinking_delta")
    assert thought == THOUGHT and final.content[1].text == ANSWER and no_markers(name, thought, ANSWER)


@pytest.mark.full
@pytest.mark.parametrize("name", list(FAMILIES))
def test_budget_ends_the_thinking_in_each_format(name):
    """A model that never stops thinking: max_reasoning_tokens closes the thinking with the format's own end marker,
    and the answer follows as content, no marker in either part."""
    lm, switch = family_lm(name, forever=True)
    with ThreadServer(_app(lm)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        body = ask(switch)
        body["extra_body"] = {**body["extra_body"], "max_reasoning_tokens": 5}
        whole = client.chat.completions.create(messages=QUESTION, **body).choices[0]
        streamed = list(client.chat.completions.create(messages=QUESTION, stream=True, **body))
    reasoning = whole.message.model_extra["reasoning_content"]
    assert reasoning and (THOUGHT * 3).startswith(reasoning), reasoning
    # harmony's scripted model goes on from the forced "<|message|>" with its thinking's chain, up to max_tokens
    assert whole.message.content == ANSWER if name != "harmony" else whole.message.content.startswith("The Paris")
    assert no_markers(name, reasoning, whole.message.content)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == whole.message.content
    assert "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                   for c in streamed) == reasoning


def test_harmony_reasoning_effort_reaches_the_template_not_a_budget():
    tokenizer = family_tokenizer("harmony")
    fmt = reasoning_format(tokenizer)
    body = ChatCompletionRequest(model="m", messages=QUESTION, reasoning_effort="low")
    prompt = tokenizer.apply_chat_template(body.chat_messages(), tokenize=False, add_generation_prompt=True,
                                           **body.template_kwargs())
    assert "Reasoning: low" in prompt
    assert body.to_sampling_params({}, reasoning=fmt).preamble.budget is None, "gpt-oss decides how long it thinks"
    capped = ChatCompletionRequest(model="m", messages=QUESTION, reasoning_effort="low", max_reasoning_tokens=7)
    assert capped.to_sampling_params({}, reasoning=fmt).preamble.budget == 7
    qwen3 = reasoning_format(qwen3_tokenizer())
    assert body.to_sampling_params({}, reasoning=qwen3).preamble.budget == 512, "others: effort is a budget"


@pytest.mark.full
def test_reasoning_parser_setting_forces_or_turns_off_the_split(caplog):
    """REASONING_PARSER=none serves a thinking model's answer as plain content; a name forces that format; the
    start log says which format serves."""
    import logging

    import httpx

    from app.config import Settings
    from app.main import create_app

    caplog.set_level(logging.INFO, logger="app.openai.serving")
    lm, _ = family_lm("deepseek_r1")
    body = {"model": "qwen3-tiny", "messages": QUESTION, "temperature": 0, "max_tokens": 30}
    with ThreadServer(_app(lm)):
        assert "reasoning parser: deepseek_r1 (REASONING_PARSER=auto)" in caplog.text
    with ThreadServer(create_app(Settings(model="qwen3-tiny", reasoning_parser="none"), lm=lm)) as server:
        message = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).json()["choices"][0]["message"]
    assert message["content"] == "The Paris is</think>\n\nParis" and "reasoning_content" not in message
    with ThreadServer(create_app(Settings(model="qwen3-tiny", reasoning_parser="magistral"), lm=lm)) as server:
        message = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).json()["choices"][0]["message"]
    assert message["content"] == "The Paris is</think>\n\nParis" and message["reasoning_content"] is None
    assert "reasoning parser: none (REASONING_PARSER=none)" in caplog.text
    assert "reasoning parser: magistral (REASONING_PARSER=magistral)" in caplog.text


def test_effort_none_turns_thinking_off_where_the_template_can_else_budgets_zero():
    """Qwen3's template turns thinking off (`enable_thinking: false`); DeepSeek-R1's and gpt-oss's cannot, so the
    engine ends the thinking at once (the splitter's suite shows an end marker at the start is an empty thinking)."""
    body = ChatCompletionRequest(model="m", messages=QUESTION, reasoning_effort="none")
    assert body.to_sampling_params({}, reasoning=reasoning_format(qwen3_tokenizer())).preamble is None
    for name in ("deepseek_r1", "harmony"):
        fmt = reasoning_format(family_tokenizer(name))
        assert fmt.name == name and body.to_sampling_params({}, reasoning=fmt).preamble.budget == 0
