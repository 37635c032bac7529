"""Streaming text: incremental detokenization (never half a character) and stop strings (never shown, however the
text is split into tokens), with a real byte-level BPE tokenizer trained here in milliseconds (no downloads).

The small vocabulary splits most Chinese characters and emoji over several byte tokens, which is the case that
breaks naive streaming (a lone byte token decodes to U+FFFD).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from app.core.detokenize import IncrementalDetokenizer, decode
from app.core.stopping import StopStringFilter, token_finish_reason

EOS = "<|endoftext|>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, how are you today?",
    "Streaming text, one token at a time, never half a character.",
    "你好，世界！今天天气很好。",
    "我们一起学习中文和英文。",
    "Emoji time 😀🎉👍🔥🌍 and more ❤️",
    "混合 mixed 文本 text 😀 ok",
] * 10

# ---------------------------------------------------------------- a real byte-level BPE tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return _tokenizer()


_CACHE: dict[str, PreTrainedTokenizerFast] = {}


def _tokenizer() -> PreTrainedTokenizerFast:
    """Trained once per session (hypothesis tests can't take function-scoped fixtures, so they call this)."""
    if "tok" not in _CACHE:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=[EOS], show_progress=False)
        tok.train_from_iterator(CORPUS, trainer=trainer)
        _CACHE["tok"] = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    return _CACHE["tok"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which ByteLevel uses for its 256 single-byte tokens."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BYTE_CHARS = _bytes_to_unicode()


def byte_token_ids(tok, text: str) -> list[int]:
    """One token per UTF-8 byte: the worst split a model can produce (every multi-byte character is cut)."""
    ids = tok.convert_tokens_to_ids([BYTE_CHARS[b] for b in text.encode("utf-8")])
    assert tok.unk_token_id is None or tok.unk_token_id not in ids
    return ids


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def token_stream(tok, pieces: list[tuple[str, bool]]) -> list[int]:
    """Token ids for text given as (piece, as_bytes) pieces: each piece either BPE-encoded or byte by byte. Byte-level
    BPE is lossless, so any such stream decodes to the concatenated text; it is a different *token split* of it."""
    ids: list[int] = []
    for piece, as_bytes in pieces:
        ids += byte_token_ids(tok, piece) if as_bytes else encode(tok, piece)
    return ids


def stream(tok, ids: list[int], prompt_ids: list[int] = ()) -> tuple[list[str], str]:
    det = IncrementalDetokenizer(tok, prompt_ids)
    return [det.add(i) for i in ids], det.flush()


def test_tokenizer_really_splits_characters(tokenizer):
    """The premise of these tests: some characters span several tokens and a lone token decodes to U+FFFD."""
    for text in ("世界", "😀", "👨‍👩‍👧"):
        ids = encode(tokenizer, text)
        assert decode(tokenizer, ids) == text
        assert any("\ufffd" in decode(tokenizer, [i]) for i in ids), text
    assert len(encode(tokenizer, "Hello world")) < len("Hello world")  # and it did learn merges


# ---------------------------------------------------------------- incremental detokenization

TEXTS = [
    "你好，世界！今天天气很好。",
    "Hello 👋 world 🌍🎉!",
    "混合 mixed 文本 text 和 emoji 😀😃😄 ok",
    "👨‍👩‍👧‍👦 family, 🇯🇵 flag, ❤️ heart",
    "日本語のテキスト、한국어 텍스트, café naïve Ωμέγα",
    "a\n\n  b\t😀\n你",
    "😀",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("split", ["bpe", "bytes"])
@pytest.mark.parametrize("prompt", ["", "前缀 prefix 😀 ", "x"])
def test_streamed_deltas_never_contain_half_characters(tokenizer, text, split, prompt):
    ids = encode(tokenizer, text) if split == "bpe" else byte_token_ids(tokenizer, text)
    assert decode(tokenizer, ids) == text
    deltas, rest = stream(tokenizer, ids, encode(tokenizer, prompt))
    assert not any("\ufffd" in d for d in deltas), deltas
    assert "".join(deltas) + rest == decode(tokenizer, ids) == text
    assert rest == ""  # valid text: every character is released as soon as its last byte arrives
    if split == "bytes":  # ... and not later: each character appears with the token that completes it
        completes = []
        for ch in text:
            completes += [""] * (len(ch.encode("utf-8")) - 1) + [ch]
        assert deltas == completes


def test_truly_incomplete_bytes_come_out_at_flush(tokenizer):
    """A model can stop in the middle of a character; the held bytes are not lost, flush shows what decode shows."""
    ids = encode(tokenizer, "ok ") + byte_token_ids(tokenizer, "😀")[:2]
    deltas, rest = stream(tokenizer, ids)
    assert "".join(deltas) == "ok "
    assert "".join(deltas) + rest == decode(tokenizer, ids)
    assert rest.endswith("\ufffd")


def test_invalid_bytes_mid_text_do_not_stall_the_stream(tokenizer):
    """A stray continuation byte is shown (as U+FFFD, like decode) once later text makes clear it won't complete."""
    ids = encode(tokenizer, "ab") + byte_token_ids(tokenizer, "😀")[1:2] + encode(tokenizer, "cd 你好")
    deltas, rest = stream(tokenizer, ids)
    assert "".join(deltas) + rest == decode(tokenizer, ids)
    assert "".join(deltas).endswith("你好")


def test_special_tokens_are_not_streamed(tokenizer):
    ids = encode(tokenizer, "Hi ") + [tokenizer.eos_token_id] + encode(tokenizer, "你好")
    deltas, rest = stream(tokenizer, ids)
    assert "".join(deltas) + rest == decode(tokenizer, ids) == "Hi 你好"


def test_a_long_run_of_skipped_special_tokens_costs_linear_work(tokenizer):
    """With EOS ignored, a model can emit thousands of special tokens that show nothing; each add() used to decode
    the whole growing run again (quadratic on the engine thread). Counted in decoded ids, not timed."""
    decoded = []

    class Counting:
        all_special_ids = tokenizer.all_special_ids

        def decode(self, ids, **kwargs):
            decoded.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    special = [tokenizer.eos_token_id]
    for run in (1_000, 10_000):
        decoded.clear()
        ids = encode(tokenizer, "Hi ") + special * run + encode(tokenizer, "你好")
        deltas, rest = stream(Counting(), ids)
        assert "".join(deltas) + rest == "Hi 你好"
        assert sum(decoded) < 100  # the window never holds the skipped ids


def test_a_long_run_of_invalid_bytes_costs_flat_work_per_token(tokenizer):
    """Issue 34: logit_bias pushed a model onto a lone continuation byte (SmolLM2's id 111, Qwen's 94: 0xA1), and
    the window, always ending in U+FFFD, was decoded whole again on every token (8,000 tokens: 5.6 s of engine
    time). Now each token costs a bounded decode, the bytes come out as decode's U+FFFDs while they stream, and
    the streamed text still equals the one-shot decode. Counted in decoded ids, not timed."""
    calls: list[int] = []

    class Counting:
        all_special_ids = tokenizer.all_special_ids

        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    stray = byte_token_ids(tokenizer, "😀")[1]  # a continuation byte: never the start of a character
    per_token = {}
    for run in (1_000, 4_000):
        calls.clear()
        ids = encode(tokenizer, "Hi ") + [stray] * run + encode(tokenizer, " 你好")
        deltas, rest = stream(Counting(), ids, encode(tokenizer, "prompt"))
        assert "".join(deltas) + rest == decode(tokenizer, ids) == "Hi " + "\ufffd" * run + " 你好"
        assert "".join(deltas[: run // 2]).count("\ufffd") >= run // 2 - 8, "the bytes stream, they are not held"
        assert max(calls) <= 40, "every decode sees a bounded window"
        per_token[run] = sum(calls) / len(ids)
    assert per_token[4_000] <= 1.05 * per_token[1_000], per_token  # flat, not growing with the run



def test_a_tail_with_no_clean_cut_is_still_bounded():
    """A decoder whose text ends in U+FFFD at every length and never splits cleanly (no real tokenizer does
    this): the window is cut anyway, so the work per token stays bounded and the text keeps coming."""
    calls: list[int] = []

    class NeverComplete:
        all_special_ids = ()

        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return "x" * len(ids) + "\ufffd"

    det = IncrementalDetokenizer(NeverComplete())
    deltas = [det.add(7) for _ in range(2_000)]
    assert max(calls) <= 40
    assert sum(len(d) for d in deltas) > 1_500

@pytest.mark.full
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(st.one_of(st.binary(min_size=1, max_size=6).map(lambda b: (b, True)),
                                 st.sampled_from(["ok ", "你好", "😀", "a"]).map(lambda t: (t.encode(), False))),
                       max_size=40))
def test_any_byte_stream_streams_what_decode_shows(pieces):
    """Valid or not (stray continuation bytes, truncated characters, overlong starts), the streamed text is the
    one-shot decode, and no delta ends in half of a character that later tokens complete."""
    tok = _tokenizer()
    ids = []
    for raw, as_bytes in pieces:
        ids += tok.convert_tokens_to_ids([BYTE_CHARS[b] for b in raw]) if as_bytes else encode(tok, raw.decode())
    deltas, rest = stream(tok, ids)
    assert "".join(deltas) + rest == decode(tok, ids)


# ---------------------------------------------------------------- stop strings


def expected_cut(text: str, stops) -> tuple[str, bool]:
    """The text a user must see: cut where the first stop string *completes* (the moment generation stops), the
    stop string excluded; among stops completing at the same character, the one starting earliest. (A stop that
    starts earlier but would complete later, like "abcd" vs "c" in "abcd", never completes: generation has stopped.)
    """
    best = None
    for s in stops:
        i = text.find(s)  # the first occurrence of s is also where s completes first
        if i >= 0:
            best = min(best or (i + len(s), i), (i + len(s), i))
    return (text, False) if best is None else (text[: best[1]], True)


def run_filter(chunks, stops) -> tuple[list[str], bool]:
    """What the server does: feed deltas, stop at the first match, flush at the end otherwise."""
    f = StopStringFilter(stops)
    out: list[str] = []
    for chunk in chunks:
        safe, hit = f.feed(chunk)
        out.append(safe)
        if hit:
            return out, True
    out.append(f.flush())
    return out, False


def run_tokens(tok, ids, stops) -> tuple[list[str], bool]:
    """Token ids -> IncrementalDetokenizer -> StopStringFilter, as the engine streams a response."""
    det, f, out = IncrementalDetokenizer(tok), StopStringFilter(stops), []
    for i in ids:
        delta = det.add(i)
        assert "\ufffd" not in delta
        safe, hit = f.feed(delta)
        out.append(safe)
        if hit:
            return out, True
    safe, hit = f.feed(det.flush())
    out.append(safe)
    if hit:
        return out, True
    out.append(f.flush())
    return out, False


def assert_user_sees(out: list[str], stopped: bool, text: str, stops) -> None:
    shown = "".join(out)
    assert (shown, stopped) == expected_cut(text, stops)
    assert not any(s in shown for s in stops)
    assert "\ufffd" not in shown


ascii_chars = st.sampled_from(list("abc #\n.")) | st.characters(min_codepoint=0x20, max_codepoint=0x7E)
cjk_chars = st.sampled_from(list("你好世界中文")) | st.characters(min_codepoint=0x4E00, max_codepoint=0x4FFF)
emoji = st.sampled_from(["😀", "🎉", "👍", "🔥", "❤️", "👨‍👩‍👧", "🇯🇵"]) | st.characters(min_codepoint=0x1F300,
                                                                                       max_codepoint=0x1F5FF)
texts = st.lists(st.one_of(ascii_chars, ascii_chars, cjk_chars, emoji), max_size=30).map("".join)


@st.composite
def text_and_stops(draw):
    text = draw(texts)
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        if text and draw(st.booleans()):  # a stop that really occurs in the text
            i = draw(st.integers(0, len(text) - 1))
            j = draw(st.integers(i + 1, min(len(text), i + 6)))
            stops.append(text[i:j])
        else:  # one that may or may not occur
            stops.append(draw(st.lists(st.one_of(ascii_chars, cjk_chars, emoji), min_size=1, max_size=4)
                              .map("".join)))
    return text, stops


@pytest.mark.full
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=text_and_stops(), cuts=st.lists(st.integers(0, 40), max_size=12))
def test_stop_filter_output_does_not_depend_on_chunking(data, cuts):
    text, stops = data
    points = sorted({c for c in cuts if 0 < c < len(text)})
    chunks = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    assert_user_sees(*run_filter(chunks, stops), text, stops)
    assert_user_sees(*run_filter(list(text), stops), text, stops)  # one character at a time
    assert_user_sees(*run_filter([text], stops), text, stops)  # all at once


@pytest.mark.full
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=text_and_stops(), cuts=st.lists(st.integers(0, 40), max_size=8), as_bytes=st.lists(st.booleans(),
                                                                                                 min_size=9, max_size=9))
def test_token_stream_with_stops_shows_the_cut_text(data, cuts, as_bytes):
    """Real token streams with random token splits: pieces of the text BPE-encoded or cut into single byte tokens."""
    tok = _tokenizer()
    text, stops = data
    points = sorted({c for c in cuts if 0 < c < len(text)})
    pieces = [(text[a:b], flag) for a, b, flag in zip([0] + points, points + [len(text)], as_bytes)]
    ids = token_stream(tok, pieces)
    assert decode(tok, ids) == text
    assert_user_sees(*run_tokens(tok, ids, stops), text, stops)


@pytest.mark.parametrize("text,stops,split", [
    ("Hello world, bye", ["o w"], "bpe"),  # "Hello" + " wor": the stop starts in one token, ends in the next
    ("你好世界和平", ["好世"], "bytes"),  # spans 6 single-byte tokens
    ("你好，世界！", ["世界"], "bpe"),  # "世" shares a token with the first byte of "界"
    ("party 🎉 time", ["🎉"], "bytes"),
    ("line one\n\nline two", ["\n\n"], "bytes"),
    ("Emoji time 😀🎉 and more", ["😀🎉 a"], "bpe"),
])
def test_stop_string_spanning_tokens(tokenizer, text, stops, split):
    ids = encode(tokenizer, text) if split == "bpe" else byte_token_ids(tokenizer, text)
    # premise: no single token's text contains the whole stop
    assert not any(s in decode(tokenizer, [i]) for s in stops for i in ids)
    out, stopped = run_tokens(tokenizer, ids, stops)
    assert stopped
    assert "".join(out) == text[: text.find(stops[0])]


def test_start_of_a_stop_string_is_held_until_it_is_decided():
    f = StopStringFilter(["\n\n"])
    assert f.feed("Hello\n") == ("Hello", False)  # "\n" might become "\n\n": not shown yet
    assert f.feed("\nWorld") == ("", True)  # it did: the user never sees it
    f = StopStringFilter(["\n\n"])
    assert f.feed("Hello\n") == ("Hello", False)
    assert f.feed("World") == ("\nWorld", False)  # it didn't: shown as soon as that is clear


def test_flush_releases_text_that_never_became_a_stop():
    f = StopStringFilter(["###"])
    assert f.feed("ab##") == ("ab", False)
    assert f.flush() == "##"
    f = StopStringFilter(["###"])
    assert [f.feed(c) for c in ["a#", "#", "b"]] == [("a", False), ("", False), ("##b", False)]
    assert f.flush() == ""


def test_flush_through_the_detokenizer(tokenizer):
    out, stopped = run_tokens(tokenizer, encode(tokenizer, "score: 10 ##"), ["###"])
    assert not stopped and "".join(out) == "score: 10 ##"
    assert out[-1] != ""  # the held "##" (or part of it) came out at the end, not before


def test_earliest_stop_wins_and_no_stops_passes_through():
    assert run_filter(["xab", "y"], ["y", "ab"]) == (["x"], True)
    assert run_filter(["x", "aby"], ["by", "ab"]) == (["x", ""], True)
    assert run_filter(["xab"], ["b", "ab"]) == (["x"], True)  # both complete at "b": the longer one is cut
    f = StopStringFilter([])
    assert f.feed("anything ###") == ("anything ###", False)
    assert f.flush() == ""


def test_stop_that_would_complete_later_loses_to_one_completed_now():
    """With stops "abcd" and "c", the text "abcd" stops at "c" however the tokens split it."""
    for chunks in (["abcd"], ["abc", "d"], ["a", "b", "c", "d"], ["ab", "cd"]):
        assert "".join(run_filter(chunks, ["abcd", "c"])[0]) == "ab", chunks


# ---------------------------------------------------------------- finish reasons


EOS_IDS = frozenset({0, 7})


def test_eos_is_stop_and_budget_is_length():
    assert token_finish_reason(7, 3, 10, EOS_IDS) == "stop"
    assert token_finish_reason(0, 1, 10, EOS_IDS) == "stop"  # any of several EOS ids
    assert token_finish_reason(5, 3, 10, EOS_IDS) is None
    assert token_finish_reason(5, 9, 10, EOS_IDS) is None
    assert token_finish_reason(5, 10, 10, EOS_IDS) == "length"
    assert token_finish_reason(7, 10, 10, EOS_IDS) == "stop"  # EOS as the last allowed token: a natural stop


def test_ignore_eos_runs_to_the_budget():
    assert token_finish_reason(7, 3, 10, EOS_IDS, ignore_eos=True) is None
    assert token_finish_reason(7, 10, 10, EOS_IDS, ignore_eos=True) == "length"


def test_min_tokens_defers_eos():
    assert token_finish_reason(7, 3, 10, EOS_IDS, min_tokens=5) is None
    assert token_finish_reason(7, 4, 10, EOS_IDS, min_tokens=5) is None
    assert token_finish_reason(7, 5, 10, EOS_IDS, min_tokens=5) == "stop"
    assert token_finish_reason(5, 10, 10, EOS_IDS, min_tokens=10) == "length"


def test_generation_loop_finish_reasons():
    """A toy decode loop: what finish_reason and how many tokens a user gets."""
    def run(tokens, max_tokens, **kw):
        for n, t in enumerate(tokens, start=1):
            if reason := token_finish_reason(t, n, max_tokens, EOS_IDS, **kw):
                return n, reason
        raise AssertionError("ran out of tokens")

    tokens = [3, 4, 7, 5, 6, 0, 8, 9, 10, 11]
    assert run(tokens, 10) == (3, "stop")
    assert run(tokens, 2) == (2, "length")
    assert run(tokens, 10, min_tokens=4) == (6, "stop")
    assert run(tokens, 10, ignore_eos=True) == (10, "length")
