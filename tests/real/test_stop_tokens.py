"""Stop strings that are special tokens, on the real embedded tokenizers: decoding skips special tokens, so
`<|im_end|>` can only match as a token id. `</s>` is plain text in both tokenizers and still matches as text."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from app.core.generate import generate
from app.core.sampling import SamplingParams
from app.core.stopping import special_stop_ids
from conftest import MODEL_CACHE

pytestmark = pytest.mark.real_model


@pytest.mark.parametrize("name,im_end,endoftext", [("qwen2.5-coder-0.5b-instruct", 151645, 151643),
                                                    ("smollm2-135m-instruct", 2, 0)])
def test_special_stop_strings_become_ids(name, im_end, endoftext):
    tokenizer = AutoTokenizer.from_pretrained(MODEL_CACHE / name)
    assert special_stop_ids(tokenizer, ["<|im_end|>"]) == {im_end}
    assert special_stop_ids(tokenizer, ["<|endoftext|>", "\n\n", "<|im_end|>"]) == {im_end, endoftext}
    # not special: left to text matching, where they can be seen
    assert special_stop_ids(tokenizer, ["</s>", "im_end", "<|im_end|> "]) == frozenset()
    assert tokenizer.decode(tokenizer.encode("a</s>b", add_special_tokens=False), skip_special_tokens=True) == "a</s>b"


def test_im_end_stop_string_ends_smollm_even_with_ignore_eos(smollm_fp32):
    lm = smollm_fp32
    ids = lm.encode_chat([{"role": "user", "content": "Say hello."}])
    im_end = lm.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def run(**params):
        events = list(generate(lm.model, lm.tokenizer, ids, SamplingParams(do_sample=False, max_tokens=48, **params),
                               lm.eos_ids, lm.max_context))
        return [e.token_id for e in events], "".join(e.text for e in events), events[-1].finish_reason

    tokens, text, reason = run()  # control: the greedy answer ends its turn with <|im_end|>, its EOS
    assert reason == "stop" and tokens[-1] == im_end
    for params in ({"stop": ("<|im_end|>",)}, {"stop_token_ids": (im_end,)}):
        # ignore_eos: only the request's own stop can end it there
        assert run(ignore_eos=True, **params) == (tokens, text, "stop"), params
