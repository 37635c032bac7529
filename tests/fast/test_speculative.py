"""N-gram speculation: the drafter on its own, draft verification on a tiny model, and the engine with speculation
on against off: the same greedy tokens, the same seeded sampled tokens, and stops that behave exactly the same."""

from __future__ import annotations

import pytest
import torch

from app.core.runner.packed import enable_packed_batching
from app.core.generate import generate
from app.core.runner.forward import forward
from app.core.sequence import Sequence
from app.core.sampling import SamplingParams
from app.core.speculative import MAX_DRAFT, NgramDrafter, accept_drafts
from engine_runs import run_engine

CODE = "def reverse(s):\n    return s[::-1]\n\nprint(reverse('hello world'))\n"


class FakeSeq:
    """What the drafter reads from a Sequence."""

    def __init__(self, ids: list[int], max_new_tokens: int = 100):
        self.token_ids = torch.zeros(1, len(ids) + max_new_tokens, dtype=torch.long)
        self.token_ids[0, : len(ids)] = torch.tensor(ids)
        self.length = self.prompt_len = len(ids)
        self.max_new_tokens = max_new_tokens

    @property
    def n_generated(self) -> int:
        return self.length - self.prompt_len

    def append(self, token: int) -> None:
        self.token_ids[0, self.length] = token
        self.length += 1


def test_drafts_continue_the_most_recent_earlier_occurrence():
    seq = FakeSeq([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3])
    drafter = NgramDrafter()
    drafts = drafter.propose(seq)
    assert drafts[:2] == [7, 8]  # "1 2 3" last seen before "7 8", not before "4 5"
    assert seq.token_ids[0, seq.length : seq.length + len(drafts)].tolist() == drafts  # written as scratch
    assert seq.length == 15  # ... but not part of the sequence


def test_no_draft_without_an_earlier_match_and_never_the_suffix_itself():
    assert NgramDrafter().propose(FakeSeq([5, 6, 7, 8])) == []
    seq = FakeSeq([5, 6, 7, 8])
    drafter = NgramDrafter()
    drafter.propose(seq)
    seq.append(5), seq.append(6)
    assert drafter.propose(seq)[:2] == [7, 8]  # the index grows with the output


def test_drafts_leave_room_for_max_tokens():
    seq = FakeSeq([1, 2, 3, 4, 5, 6, 7, 8, 1, 2], max_new_tokens=3)
    assert len(NgramDrafter().propose(seq)) == 2  # two drafts + the token after them = the three allowed
    seq.length += 2  # two generated: one left, so nothing to draft
    assert NgramDrafter().propose(seq) == []


def test_draft_length_follows_the_acceptance_rate():
    drafter = NgramDrafter()
    start = drafter.draft_len()
    assert 1 <= start < MAX_DRAFT
    for _ in range(10):
        drafter.record(drafted=drafter.draft_len(), accepted=drafter.draft_len())
    assert drafter.draft_len() == MAX_DRAFT  # everything accepted: draft as far as allowed
    for _ in range(10):
        drafter.record(drafted=max(drafter.draft_len(), 1), accepted=0)
    assert drafter.draft_len() == 0  # nothing accepted: stop drafting (open-ended chat must not pay for it)
    seq = FakeSeq([1, 2, 3, 1, 2])
    for _ in range(20):
        drafter.propose(seq)  # steps without drafting forget the old evidence...
    assert drafter.draft_len() >= 1  # ...so drafting is tried again later


def prefilled(lm, ids, params):
    seq = Sequence(lm.model, lm.tokenizer, ids, params, lm.eos_ids, lm.max_context)
    forward(lm.model, [(seq, len(ids))])
    return seq


def verify(lm, seq, drafts):
    seq.token_ids[0, seq.length : seq.length + len(drafts)] = torch.tensor(drafts)
    logits = forward(lm.model, [(seq, 1 + len(drafts))], [1 + len(drafts)])
    assert logits.shape == (1 + len(drafts), lm.vocab_size)
    return accept_drafts(seq, logits, drafts)


def test_verification_accepts_the_agreeing_prefix_and_crops_the_rest(tiny_lm):
    assert enable_packed_batching(tiny_lm.model)
    ids = tiny_lm.encode_text(CODE)
    params = SamplingParams(max_tokens=12, do_sample=False, ignore_eos=True)
    expected = [e.token_id for e in generate(tiny_lm.model, tiny_lm.tokenizer, ids, params, tiny_lm.eos_ids,
                                             tiny_lm.max_context)]
    seq = prefilled(tiny_lm, ids, params)
    seq.accept(expected[0], torch.zeros(1, tiny_lm.vocab_size))  # the first token, as the engine would
    # drafts: two right, then a wrong one, then one that would be right but comes after the miss
    wrong = (expected[3] + 1) % tiny_lm.vocab_size
    events, accepted = verify(tiny_lm, seq, [expected[1], expected[2], wrong, expected[4]])
    assert accepted == 2
    assert [e.token_id for e in events] == expected[1:4]  # two drafts, then the model's own token
    assert seq.length == len(ids) + 4
    assert seq.cache.get_seq_length() == seq.length - 1  # the rejected drafts' keys are gone
    events, accepted = verify(tiny_lm, seq, expected[4:8])  # all right: four drafts and the token after them
    assert accepted == 4 and [e.token_id for e in events] == expected[4:9]
    assert seq.cache.get_seq_length() == seq.length - 1


def test_verification_never_emits_past_the_end(tiny_lm):
    assert enable_packed_batching(tiny_lm.model)
    ids = tiny_lm.encode_text(CODE)
    params = SamplingParams(max_tokens=3, do_sample=False, ignore_eos=True)
    expected = [e.token_id for e in generate(tiny_lm.model, tiny_lm.tokenizer, ids, params, tiny_lm.eos_ids,
                                             tiny_lm.max_context)]
    seq = prefilled(tiny_lm, ids, params)
    seq.accept(expected[0], torch.zeros(1, tiny_lm.vocab_size))
    events, _ = verify(tiny_lm, seq, expected[1:3])  # more drafts than tokens left: stops at max_tokens
    assert [e.token_id for e in events] == expected[1:3] and events[-1].finish_reason == "length"


def engine_requests(lm):
    code = lm.encode_text(CODE * 2)
    chat = lm.encode_chat([{"role": "user", "content": "Tell me about Paris and the Seine."}])
    return [
        (code, SamplingParams(max_tokens=60, do_sample=False, ignore_eos=True)),
        (code, SamplingParams(max_tokens=40, seed=3, temperature=0.8, top_k=50, ignore_eos=True)),
        (code, SamplingParams(max_tokens=40, seed=4, repetition_penalty=1.2, top_p=0.9)),
        (chat, SamplingParams(max_tokens=30, do_sample=False)),
    ]


def test_engine_output_is_the_same_with_and_without_speculation(tiny_lm):
    requests = engine_requests(tiny_lm)
    off, _ = run_engine(tiny_lm, requests, together=True, speculative="off", prefix_cache_bytes=0)
    on, engine = run_engine(tiny_lm, requests, together=True, speculative="ngram", prefix_cache_bytes=0)
    assert on == off  # greedy, seeded sampled (with penalties: the prefix includes accepted drafts) and chat
    assert engine.metrics.accepted_tokens._value.get() > 0  # drafts were verified and used, not skipped


def test_stop_strings_end_a_verified_row_exactly_as_without_it(tiny_lm):
    requests = engine_requests(tiny_lm)
    greedy = run_engine(tiny_lm, requests[:1], speculative="off", prefix_cache_bytes=0)[0][0]
    # stop on a piece of text that first appears late in the answer, in the repetitive part that drafts cover
    text = greedy.text
    stop = next(text[i : i + 3] for i in range(len(text) - 3, 0, -1)
                if text[i : i + 3].isprintable() and "\ufffd" not in text[i : i + 3] and text.find(text[i : i + 3]) == i)
    assert text.find(stop) > len(text) // 2, (text, stop)
    params = SamplingParams(max_tokens=60, do_sample=False, ignore_eos=True, stop=(stop,))
    off = run_engine(tiny_lm, [(requests[0][0], params)], speculative="off", prefix_cache_bytes=0)[0][0]
    on, engine = run_engine(tiny_lm, [(requests[0][0], params)], speculative="ngram", prefix_cache_bytes=0)
    assert on[0] == off and off.finish_reason == "stop" and stop not in off.text
    assert engine.metrics.accepted_tokens._value.get() > 0


@pytest.mark.real_model
def test_qwen_greedy_tokens_are_the_same_with_speculation(qwen_fp32):
    source = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
    prompt = qwen_fp32.encode_chat([{"role": "user", "content": f"Rename `a` to `x` in this code:\n{source}"}])
    requests = [(prompt, SamplingParams(max_tokens=32, do_sample=False))]
    off, _ = run_engine(qwen_fp32, requests, speculative="off", prefix_cache_bytes=0)
    on, engine = run_engine(qwen_fp32, requests, speculative="ngram", prefix_cache_bytes=0)
    assert on == off
    assert engine.metrics.accepted_tokens._value.get() > 0


def test_sliding_window_models_run_without_either_shortcut(tiny_lm):
    """A window that has moved on cannot be cropped back, nor a whole prefix stored: both shortcuts stay off, and
    the answer is the model's own."""
    from transformers import MistralConfig

    from test_batching import hf_greedy, tiny_variant

    lm = tiny_variant(tiny_lm, MistralConfig, sliding_window=8)
    ids = lm.encode_text(CODE)
    seen, engine = run_engine(lm, [(ids, SamplingParams(max_tokens=12, do_sample=False, ignore_eos=True))],
                              speculative="ngram", prefix_cache_bytes=2**20)
    assert engine.speculative == "off" and engine.prefix_cache is None
    assert seen[0].tokens == hf_greedy(lm, ids, 12)
