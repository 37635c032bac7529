"""Grammar masks in the decode loop, on the tiny model: valid documents, EOS, padding ids, whitespace, batching."""

from __future__ import annotations

import json

import pytest
import torch

from app.structured.grammars import MAX_WHITESPACE, Grammars, check_schema
from app.core.generate import decode_step, generate, prefill
from app.core.sequence import Sequence, choose_many
from app.core.sampling import SamplingParams
from app.errors import InvalidRequest

from conftest import build_tiny_model

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "color", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def grammars(tiny_lm):
    return Grammars(tiny_lm.tokenizer, tiny_lm.vocab_size, tiny_lm.eos_ids)


PADDED = 48  # like Qwen: config vocab 151,936 > tokenizer 151,665


@pytest.fixture(scope="module")
def padded_grammars(tiny_tokenizer):
    """Grammars for a model vocabulary PADDED ids past the tokenizer's. One for the module: each starts a compile
    worker process, ~30 s under make test-avx2's emulator."""
    return Grammars(tiny_tokenizer, len(tiny_tokenizer) + PADDED, [tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")])


def run(lm, grammar, **params):
    prompt = lm.encode_chat([{"role": "user", "content": "Give me JSON."}])
    events = list(generate(lm.model, lm.tokenizer, prompt, SamplingParams(grammar=grammar, **params), lm.eos_ids,
                           lm.max_context))
    return "".join(e.text for e in events), events


@pytest.mark.full
def test_greedy_answer_is_a_valid_document_ended_by_eos(tiny_lm, grammars):
    text, events = run(tiny_lm, grammars.json_schema(SCHEMA), temperature=0, max_tokens=120)
    doc = json.loads(text)
    assert set(doc) == {"ok", "color", "n"} and doc["color"] in ("red", "green") and 0 <= doc["n"] <= 9
    assert events[-1].finish_reason == "stop" and events[-1].token_id in tiny_lm.eos_ids


def test_unconstrained_tiny_model_does_not_write_json_by_itself(tiny_lm):
    text, _ = run(tiny_lm, None, temperature=0, max_tokens=40)
    with pytest.raises(ValueError):
        json.loads(text)  # so the test above measures the grammar, not luck


@pytest.mark.full
def test_sampled_answers_are_valid_and_reproducible_by_seed(tiny_lm, grammars):
    grammar = grammars.json_schema(SCHEMA)
    texts = [run(tiny_lm, grammar, temperature=1.0, seed=s, max_tokens=120)[0] for s in (1, 2, 1)]
    for text in texts:
        assert json.loads(text)["color"] in ("red", "green")
    assert texts[0] == texts[2]


@pytest.mark.full
def test_json_object_allows_any_object(tiny_lm, grammars):
    text, events = run(tiny_lm, grammars.json_schema({"type": "object"}), temperature=0, max_tokens=200)
    if events[-1].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # the random model may keep a string going; what it wrote is still an object's start
        assert text.lstrip().startswith("{")


def test_eos_is_masked_until_the_document_is_complete(tiny_lm, grammars):
    eos = tiny_lm.eos_ids[0]
    matcher = grammars.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                    "required": ["a"]}).matcher()
    logits = torch.zeros(1, tiny_lm.vocab_size)
    assert matcher.mask(logits)[0, eos] == -torch.inf
    for token in tiny_lm.tokenizer.encode('{"a": 1}'):
        assert matcher.accept(token)
    allowed = (matcher.mask(logits)[0] > -torch.inf).nonzero().flatten().tolist()
    assert eos in allowed and all(tiny_lm.tokenizer.decode([t]).strip() == "" or t in tiny_lm.eos_ids
                                  for t in allowed) and len(allowed) < 10


@pytest.mark.full
def test_padding_ids_past_the_tokenizer_stay_masked(tiny_tokenizer, padded_grammars):
    padded = len(tiny_tokenizer) + PADDED
    matcher = padded_grammars.json_schema({"type": "object"}).matcher()
    masked = matcher.mask(torch.zeros(1, padded))
    assert masked.shape == (1, padded)
    assert torch.all(masked[0, len(tiny_tokenizer):] == -torch.inf)
    assert torch.any(masked[0, : len(tiny_tokenizer)] == 0)


def test_whitespace_is_bounded(tiny_lm, grammars):
    matcher = grammars.json_schema(SCHEMA).matcher()
    assert matcher.matcher.accept_string("{" + " " * MAX_WHITESPACE)
    assert not matcher.matcher.accept_string(" ")  # one more is refused


def test_rows_without_a_grammar_are_untouched_in_a_batch(tiny_lm, grammars):
    """A constrained row next to plain rows: each row's token equals what it gets alone."""
    lm = tiny_lm
    prompt = lm.encode_chat([{"role": "user", "content": "Give me JSON."}])
    grammar = grammars.json_schema(SCHEMA)
    configs = [SamplingParams(temperature=0, max_tokens=8), SamplingParams(grammar=grammar, temperature=0.9, seed=3,
                                                                           max_tokens=8),
               SamplingParams(temperature=0.9, seed=4, max_tokens=8)]

    def tokens(batch: bool) -> list[list[int]]:
        seqs = [Sequence(lm.model, lm.tokenizer, prompt, p, lm.eos_ids, lm.max_context) for p in configs]
        logits = torch.cat([prefill(lm.model, s) for s in seqs])
        out: list[list[int]] = [[] for _ in seqs]
        for _ in range(6):
            events = choose_many(seqs, logits) if batch else [s.choose(logits[i:i + 1]) for i, s in enumerate(seqs)]
            for row, event in zip(out, events):
                row.append(event.token_id)
            logits = torch.cat([decode_step(lm.model, s) for s in seqs])
        return out

    assert tokens(batch=True) == tokens(batch=False)
    assert not Sequence(lm.model, lm.tokenizer, prompt, configs[1], lm.eos_ids, lm.max_context).plain_greedy


def test_compiled_grammars_are_cached_by_exactly_the_schema_compiled(grammars):
    xy = {"type": "object", "properties": {"x": {"type": "string"}, "y": {"type": "integer"}}}
    a = grammars.json_schema(xy)
    assert grammars.json_schema(dict(xy)) is a
    # the same properties in another order make another grammar: output keys follow the schema's order
    b = grammars.json_schema({"type": "object", "properties": {"y": {"type": "integer"}, "x": {"type": "string"}}})
    assert b is not a
    assert grammars.json_schema({"type": "array"}) is not a


@pytest.mark.parametrize("schema, keyword", [
    ({"not": {"type": "string"}}, "'not'"),
    ({"type": "object", "properties": {"a": {"if": {"type": "integer"}, "then": {"minimum": 1}}}}, "'if'"),
    ({"type": "string", "format": "idn-email"}, "'idn-email'"),
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, "'pattern'"),
    ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, "'allOf'"),
    ({"type": "array", "items": {"dependentSchemas": {}}}, "'dependentSchemas'"),
])
def test_schemas_the_engine_cannot_enforce_are_refused_naming_the_keyword(schema, keyword):
    with pytest.raises(InvalidRequest) as err:
        check_schema(schema, "response_format")
    assert keyword in err.value.message and err.value.param == "response_format"


def test_a_schema_the_compiler_rejects_is_a_400(grammars):
    with pytest.raises(InvalidRequest) as err:
        grammars.json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})
    assert err.value.param == "response_format"


@pytest.mark.full
def test_grammar_with_a_padded_model_vocab_generates(tiny_tokenizer, padded_grammars):
    from app.models.loading import LoadedModel

    model = build_tiny_model(len(tiny_tokenizer) + PADDED)
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    lm = LoadedModel(model=model, tokenizer=tiny_tokenizer, name="tiny", max_context=256, eos_ids=(eos,))
    text, events = run(lm, padded_grammars.json_schema(SCHEMA), temperature=0, max_tokens=120)
    assert json.loads(text)["color"] in ("red", "green")
    assert all(e.token_id < len(tiny_tokenizer) for e in events)


def test_allows_reads_the_same_bits_as_the_mask(tiny_lm, grammars):
    matcher = grammars.json_schema(SCHEMA).matcher()
    for prefix in ("", '{"ok": tr', '{"ok": true, "color": "'):
        matcher = grammars.json_schema(SCHEMA).matcher()
        assert prefix == "" or matcher.matcher.accept_string(prefix)
        masked = matcher.mask(torch.zeros(1, tiny_lm.vocab_size))[0]
        allowed = [matcher.allows(t) for t in range(tiny_lm.vocab_size)]
        assert allowed == (masked > -torch.inf).tolist() and 0 < sum(allowed) < tiny_lm.vocab_size


@pytest.mark.full
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_check_first_gives_the_tokens_of_the_full_mask(tiny_lm, grammars, monkeypatch, penalty):
    from app.structured.grammars import GrammarMatcher

    grammar = grammars.json_schema(SCHEMA)
    # a bias toward one valid document's tokens, so the random model's best token is sometimes allowed
    bias = {t: 20.0 for t in tiny_lm.tokenizer.encode('{"ok": true, "color": "red", "n": 1}')}
    params = dict(temperature=0, max_tokens=120, repetition_penalty=penalty, logit_bias=bias)
    seen = []
    allows = GrammarMatcher.allows
    monkeypatch.setattr(GrammarMatcher, "allows", lambda self, t: seen.append(allows(self, t)) or seen[-1])
    fast = [e.token_id for e in run(tiny_lm, grammar, **params)[1]]
    assert True in seen and False in seen  # the model's choice stood at some steps and was refused at others
    monkeypatch.setattr(Sequence, "_cheap_greedy_check", lambda self, logits: False)
    full = [e.token_id for e in run(tiny_lm, grammar, **params)[1]]
    assert fast == full and len(fast) > 5
