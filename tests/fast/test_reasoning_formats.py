"""Every reasoning format passes one suite, on text written in that family's format (app/openai/reasoning/):
the streamed split equals the whole one at every split point, no marker leaks into either part, the text after the
thinking is content, and thinking cut off by max_tokens stays reasoning. Then the same through token ids, where
the markers are special tokens that decoding drops; then which format `REASONING_PARSER=auto` picks.
"""

from __future__ import annotations

import pytest
from conftest import build_tiny_tokenizer
from tokenizers import AddedToken

from app.config import Settings
from app.core.detokenize import IncrementalDetokenizer
from app.openai.reasoning import PARSERS, reasoning_format
from app.openai.reasoning import granite, harmony

MARKERS = {"deepseek_r1": ("<think>", "</think>"), "qwen3": ("<think>", "</think>"), "harmony": harmony.MARKERS,
           "magistral": ("[THINK]", "[/THINK]"), "granite": granite.OPENS + granite.CLOSES}
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris"}<|call|>')

# (format, thinking, the model's text, its reasoning, its content)
CASES = [
    ("deepseek_r1", True, "Let me think.\n</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
    ("deepseek_r1", True, "<think>\nLet me think.\n</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
    ("deepseek_r1", True, "a < b and </thought> stay text</think>x", "a < b and </thought> stay text", "x"),
    ("deepseek_r1", True, "Let me think. 2 + 2 is", "Let me think. 2 + 2 is", ""),  # cut off while thinking
    ("deepseek_r1", True, "</think>\n\nAt once.", "", "At once."),  # a budget of 0 forced the end at once
    ("qwen3", True, "<think>\nI think.\n</think>\n\nAnswer.", "I think.", "Answer."),
    ("qwen3", True, "<think>\n\n</think>\n\nok", "", "ok"),
    ("qwen3", True, "<think>\nhalf way", "half way", ""),
    ("qwen3", False, "Just the answer.", "", "Just the answer."),
    ("harmony", True, "<|channel|>analysis<|message|>User asks the capital. Paris.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Paris.<|return|>", "User asks the capital. Paris.", "Paris."),
    ("harmony", True, "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>"
     " Two.<|end|><|start|>assistant<|channel|>final<|message|>Done.", "One. Two.", "Done."),
    ("harmony", True, "<|channel|>analysis<|message|>Thinking about a < b <|", "Thinking about a < b <|", ""),
    ("harmony", True, "<|channel|>final<|message|>Paris.", "", "Paris."),
    ("harmony", True, "<|end|><|start|>assistant<|channel|>final<|message|>Paris.", "", "Paris."),  # budget 0
    ("harmony", True, "Not harmony at all.", "", "Not harmony at all."),
    ("magistral", True, "[THINK]Hmm, 2+2.[/THINK]4", "Hmm, 2+2.", "4"),
    ("magistral", True, "[THINK]\nHmm [THINK is text\n[/THINK]\n\nThe answer is 4.", "Hmm [THINK is text",
     "The answer is 4."),
    ("magistral", True, "The answer is 4.", "", "The answer is 4."),
    ("magistral", True, "[THINK]Hmm, 2+", "Hmm, 2+", ""),
    ("magistral", True, "[/THINK]4", "", "4"),
    ("granite", True, "Here is my thought process:\nThe user wants 2+2.\n\nHere is my response:\nIt is 4.",
     "The user wants 2+2.", "It is 4."),
    ("granite", True, "Here's my thought process: Here, Here is, Here is my r. Here's my response: ok",
     "Here, Here is, Here is my r.", "ok"),
    ("granite", True, "It is 4.", "", "It is 4."),
    ("granite", True, "Here is my thought process:\nThe user wants", "The user wants", ""),
    ("granite", False, "Plain answer, thinking off.", "", "Plain answer, thinking off."),
]
# the contract with the harmony tool-call parser: commentary and addressed messages pass on verbatim
VERBATIM = [
    ("harmony", True, "<|channel|>analysis<|message|>Need the weather.<|end|>" + CALL, "Need the weather.", CALL),
    ("harmony", True, "<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.f<|channel|>commentary"
     " json<|message|>{}<|call|>", "x", "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}"
                                         "<|call|>"),
    ("harmony", True, " to=functions.f<|channel|>commentary json<|message|>{}", "",
     " to=functions.f<|channel|>commentary json<|message|>{}"),
    ("harmony", True, "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final"
     "<|message|>Sunny.", "", "<|channel|>commentary<|message|>Checking.<|end|>Sunny."),
]


@pytest.fixture(scope="module")
def formats():
    tokenizer = build_tiny_tokenizer()
    return {name: module.build(tokenizer) for name, module in PARSERS.items()}


def split(fmt, thinking: bool, pieces) -> tuple[str, str]:
    splitter = fmt.make_splitter(thinking, {})
    parts = [splitter.feed(piece) for piece in pieces] + [splitter.flush()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


def test_every_format_is_in_the_suite():
    assert {case[0] for case in CASES} == set(PARSERS) == set(MARKERS)


@pytest.mark.parametrize("name, thinking, text, reasoning, content", CASES + VERBATIM)
def test_streamed_equals_whole_at_every_split_point(formats, name, thinking, text, reasoning, content):
    fmt = formats[name]
    assert split(fmt, thinking, [text]) == (reasoning, content)
    for i in range(len(text) + 1):
        assert split(fmt, thinking, [text[:i], text[i:]]) == (reasoning, content), f"split at {i}: {text[:i]!r}"
    assert split(fmt, thinking, list(text)) == (reasoning, content), "a character at a time"


@pytest.mark.parametrize("name, thinking, text, reasoning, content", CASES)
def test_no_marker_leaks(formats, name, thinking, text, reasoning, content):
    """Streamed a character at a time, no marker shows, whole or in pieces (pieces would join up to it)."""
    splitter = formats[name].make_splitter(thinking, {})
    deltas = [splitter.feed(ch) for ch in text] + [splitter.flush()]
    for shown in ("".join(r for r, _ in deltas), "".join(c for _, c in deltas)):
        assert not any(m in shown for m in MARKERS[name]), shown


# ---- the same through token ids: markers that are special tokens ----

@pytest.fixture(scope="module")
def special_tokenizer():
    """A tokenizer where the harmony and Magistral markers are special tokens, as in gpt-oss's and Magistral's."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [*harmony.MARKERS, "[THINK]", "[/THINK]"]})
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    return tokenizer


@pytest.mark.parametrize("name, thinking, text, reasoning, content",
                         [c for c in CASES + VERBATIM if c[0] in ("harmony", "magistral", "deepseek_r1")])
def test_special_markers_are_put_back_from_token_ids(special_tokenizer, name, thinking, text, reasoning, content):
    """Decoding drops special tokens (skip_special_tokens); the splitter restores them from the ids it is given."""
    fmt = PARSERS[name].build(special_tokenizer)
    assert bool(fmt.markers) == (name != "deepseek_r1"), "only special markers are put back (<think> is plain)"
    ids = special_tokenizer.encode(text, add_special_tokens=False)
    detok, splitter = IncrementalDetokenizer(special_tokenizer), fmt.splitter(thinking)
    parts = [splitter.feed(detok.add(i), i) for i in ids]
    parts += [splitter.feed(detok.flush()), splitter.flush()]
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (reasoning, content)


def test_markers_flagged_special_only_in_the_vocabulary_are_put_back():
    """A tokenizer.json may flag a token special without listing it among the special tokens (`all_special_ids`);
    decoding drops it all the same, so it is restored too."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in ("[THINK]", "[/THINK]")])
    assert tokenizer.convert_tokens_to_ids("[THINK]") not in tokenizer.all_special_ids
    fmt = PARSERS["magistral"].build(tokenizer)
    detok, splitter = IncrementalDetokenizer(tokenizer), fmt.splitter(True)
    parts = [splitter.feed(detok.add(i), i) for i in tokenizer.encode("[THINK]Hmm.[/THINK]4", add_special_tokens=False)]
    parts += [splitter.feed(detok.flush()), splitter.flush()]
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == ("Hmm.", "4")


def test_budget_ids_contain_the_end_for_every_format(special_tokenizer):
    """What the engine forces when the budget runs out ends the thinking in the splitter's eyes too."""
    for name in PARSERS:
        fmt = PARSERS[name].build(special_tokenizer)
        fmt.preamble(budget=3)  # raises if the forced ids do not contain the end ids
        forced = special_tokenizer.decode(fmt.forced_end_ids)
        markers = {i: t for i, t in fmt.markers.items()}
        text = "".join(markers.get(i, special_tokenizer.decode([i])) for i in fmt.forced_end_ids)
        opened = {"harmony": "<|channel|>analysis<|message|>", "magistral": "[THINK]",
                  "granite": "Here is my thought process:"}.get(name, "")
        assert split(fmt, True, [opened + "thinking", text, "answer"]) == ("thinking", "answer"), (name, forced)


# ---- which format a model gets ----

def family_tokenizer(template: str, special=(), added=()):
    tokenizer = build_tiny_tokenizer()
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tokenizer.chat_template = template
    return tokenizer


TEMPLATES = {
    "harmony": ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
                "{% for m in messages %}{% if m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
                "{{ m.content }}<|end|>{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}", harmony.MARKERS, ()),
    "magistral": ("[SYSTEM_PROMPT]Think between [THINK] and [/THINK].[/SYSTEM_PROMPT]{% for m in messages %}"
                  "[INST]{{ m.content }}[/INST]{% endfor %}", ("[THINK]", "[/THINK]", "[INST]", "[/INST]"), ()),
    "granite": ("{% if thinking %}Write your thoughts after 'Here is my thought process:' and your response after "
                "'Here is my response:'.{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}", (), ()),
    "qwen3": ("{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking is defined and "
              "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}", (), ("<think>", "</think>")),
    "deepseek_r1": ("{% for m in messages %}{% set c = m.content %}{% if '</think>' in c %}"
                    "{% set c = c.split('</think>')[-1] %}{% endif %}{{ c }}{% endfor %}"
                    "{% if add_generation_prompt %}<think>\n{% endif %}", (), ("<think>", "</think>")),
}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_auto_picks_the_format_from_template_and_tokens(name):
    template, special, added = TEMPLATES[name]
    tokenizer = family_tokenizer(template, special, added)
    assert reasoning_format(tokenizer).name == name
    assert reasoning_format(tokenizer, "none") is None


def test_auto_finds_no_format_for_a_model_that_does_not_think():
    assert reasoning_format(build_tiny_tokenizer()) is None
    # a template that writes think tags, but the vocabulary has no </think> token: not a thinking model
    assert reasoning_format(family_tokenizer(TEMPLATES["deepseek_r1"][0])) is None


def test_a_name_forces_a_format_on_any_model():
    tokenizer = build_tiny_tokenizer()
    for name in PARSERS:
        fmt = reasoning_format(tokenizer, name)
        assert fmt.name == name and fmt.forced_end_ids


def test_thinking_switch_per_family():
    """Qwen3 thinks unless `enable_thinking` is false; Granite only with `thinking`; DeepSeek-V3.1's template has a
    `thinking` switch too (off by default), R1's has none."""
    qwen3 = reasoning_format(family_tokenizer(*TEMPLATES["qwen3"][:1], added=TEMPLATES["qwen3"][2]))
    assert qwen3.thinks({}) and not qwen3.thinks({"enable_thinking": False})
    granite_fmt = reasoning_format(family_tokenizer(TEMPLATES["granite"][0]))
    assert not granite_fmt.thinks({}) and granite_fmt.thinks({"thinking": True})
    r1 = reasoning_format(family_tokenizer(TEMPLATES["deepseek_r1"][0], added=("<think>", "</think>")))
    assert r1.thinks({})
    v31 = family_tokenizer("{% if thinking %}<think>{% else %}</think>{% endif %}", added=("<think>", "</think>"))
    v31_fmt = reasoning_format(v31)
    assert v31_fmt.name == "deepseek_r1" and not v31_fmt.thinks({}) and v31_fmt.thinks({"thinking": True})


def test_unknown_parser_name_is_refused_at_start_listing_the_names():
    with pytest.raises(ValueError) as err:
        Settings(reasoning_parser="deepseek")
    assert all(name in str(err.value) for name in ("auto", "none", *PARSERS))
    description = Settings.model_fields["reasoning_parser"].description
    assert all(name in description for name in PARSERS), "the setting's description names every parser"
