"""Images through the engine, on tiny random vision-language models of real architectures (tests/vision_models.py):
in fp32 a request with an image gets HF `generate()`'s greedy tokens on the processor's inputs, alone and sharing
its passes with text-only requests and with another image, and a request with two images does too; the prefix cache
tells images apart by their pixels; each family's checkpoint directory loads through the server's loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from app.core.engine.prefix_cache import keeps_all_keys
from app.core.sampling import SamplingParams
from app.errors import InvalidRequest
from app.models.loading import LoadedModel, load_model
from app.models.vision import VisionEncoder, text_model, vision_problem
from engine_runs import run_engine
from vision_models import FAMILIES, build, save_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def picture(seed: int, size=(40, 52)) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(*size, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    vlm, processor = build(request.param)
    tok = processor.tokenizer
    lm = LoadedModel(model=text_model(vlm), tokenizer=tok, name=request.param, max_context=512,
                     eos_ids=(tok.eos_token_id,), vision=VisionEncoder(vlm, processor, torch.float32))
    return vlm, processor, lm


def chat(tok, text: str, images: int = 1) -> str:
    content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)


def reference(vlm, processor, prompt: str, images: list[Image.Image]) -> list[int]:
    inputs = processor(text=[prompt], images=[images], return_tensors="pt")  # nested, as apply_chat_template does
    out = vlm.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def request(lm, prompt: str, images: list[Image.Image], digests: list[str]):
    ids, image_prompt = lm.vision.encode(prompt, images, digests, max_image_tokens=10_000)
    return ids, GREEDY, image_prompt


def test_an_image_request_gets_generates_tokens_alone_amid_text_and_amid_another_image(family):
    vlm, processor, lm = family
    prompt = chat(lm.tokenizer, "what is in this picture?")
    red, blue = picture(1), picture(2, size=(60, 30))
    want_red, want_blue = reference(vlm, processor, prompt, [red]), reference(vlm, processor, prompt, [blue])
    assert want_red != want_blue  # the image reaches the answer: a test that could not tell would prove nothing
    text = [(lm.tokenizer.encode(t), GREEDY) for t in ("hello there", "a longer text-only prompt", "x")]
    image_red, image_blue = request(lm, prompt, [red], ["red"]), request(lm, prompt, [blue], ["blue"])

    (alone,), _ = run_engine(lm, [image_red], prefix_cache_bytes=0)
    assert alone.tokens == want_red
    amid_text, _ = run_engine(lm, [*text[:2], image_red, text[2]], together=True, prefix_cache_bytes=0)
    assert amid_text[2].tokens == want_red
    amid_image, _ = run_engine(lm, [image_red, image_blue], together=True, prefix_cache_bytes=0)
    assert [s.tokens for s in amid_image] == [want_red, want_blue]


def test_the_prefix_cache_reuses_an_image_only_for_the_same_pixels(family):
    vlm, processor, lm = family
    prompt = chat(lm.tokenizer, "describe it " * 6)
    red, blue = picture(1), picture(2)
    image_red = request(lm, prompt, [red], ["red"])
    positions = image_red[2].positions
    seen, _ = run_engine(lm, [image_red, request(lm, prompt, [blue], ["blue"]), image_red], prefix_cache_bytes=2**24)
    first, other, again = seen
    # the second prompt has the same ids but another image: nothing from its first placeholder on may be reused
    assert other.cached_tokens <= positions[0]
    assert other.tokens == reference(vlm, processor, prompt, [blue])
    full = keeps_all_keys(lm.model.config)  # sliding-window layers (Gemma 3): no prefix cache, as for text models
    assert again.cached_tokens > positions[-1] if full else again.cached_tokens == 0  # the same image: KV reused
    assert again.tokens == first.tokens


def test_two_images_in_one_request_get_generates_tokens_and_either_image_changes_the_cache_keys(family):
    """Several images' features land in the prompt's order; the cache keys change from the first placeholder of
    the image that changed, or earlier (a family whose images take several placeholder runs keys them together)."""
    vlm, processor, lm = family
    prompt, red, blue, green = chat(lm.tokenizer, "compare them", images=2), picture(1), picture(2), picture(3)
    ids, both = lm.vision.encode(prompt, [red, blue], ["red", "blue"], max_image_tokens=10_000)
    (seen,), _ = run_engine(lm, [(ids, GREEDY, both)], prefix_cache_bytes=0)
    assert seen.tokens == reference(vlm, processor, prompt, [red, blue])

    for digests in (["green", "blue"], ["red", "green"]):
        other_ids, other = lm.vision.encode(prompt, [dict(red=red, green=green, blue=blue)[d] for d in digests],
                                            digests, max_image_tokens=10_000)
        assert other_ids == ids  # same sizes, same placeholders: only the keys can tell the prompts apart
        changed = both.positions[(both.embeds != other.embeds).any(-1)][0]  # the changed image's first placeholder
        first_difference = next((i for i, (a, b) in enumerate(zip(both.keys(ids), other.keys(ids))) if a != b), None)
        assert first_difference is not None and both.positions[0] <= first_difference <= changed


def test_a_checkpoint_dir_loads_as_a_vision_model_whose_engine_tokens_are_generates(family, tmp_path):
    """The family's checkpoint, laid out as on the hub, through the server's loader: its processor (built without
    torchvision where AutoProcessor cannot: a video processor, Pixtral's import) prepares what the original does,
    and the engine serving the loaded model gives generate's tokens."""
    vlm, processor, lm = family
    save_checkpoint(vlm, processor, tmp_path / "model")
    loaded = load_model(str(tmp_path / "model"), device="cpu", dtype="float32", prepack="false", quant="none",
                        cache_dir=tmp_path / "cache")
    assert isinstance(loaded, LoadedModel) and isinstance(loaded.vision, VisionEncoder)
    assert type(loaded.vision.processor).__name__ == type(processor).__name__
    prompt, images = chat(loaded.tokenizer, "what is in this picture?", images=2), [picture(1), picture(2, (60, 30))]
    want, got = (p(text=[prompt], images=[images], return_tensors="pt") for p in (processor, loaded.vision.processor))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    request_ = request(loaded, prompt, images, ["a", "b"])
    (seen,), _ = run_engine(loaded, [request_], prefix_cache_bytes=0)
    assert seen.tokens == reference(vlm, processor, prompt, images)


def test_too_many_image_tokens_is_a_400_naming_the_bound(family):
    _, _, lm = family
    with pytest.raises(InvalidRequest, match="MAX_IMAGE_TOKENS"):
        lm.vision.encode(chat(lm.tokenizer, "hi", images=2), [picture(1), picture(2)], ["a", "b"],
                         max_image_tokens=3)


@pytest.mark.parametrize("model_type,named", [("qwen3_vl_moe", "deepstack"), ("gemma3n", "per-layer")])
def test_families_the_packed_path_cannot_serve_exactly_are_refused_naming_what_they_have(model_type, named):
    import transformers as tf

    config = tf.AutoConfig.for_model(model_type)
    assert named in vision_problem(config, "none", 1)


def test_a_vision_model_is_refused_with_quantized_weights_or_tensor_parallel():
    import transformers as tf

    config = tf.LlavaConfig()
    assert "QUANT=int8" in vision_problem(config, "int8", 1)
    assert "TENSOR_PARALLEL" in vision_problem(config, "none", 2)
    assert vision_problem(tf.LlamaConfig(), "int8", 2) is None  # a text model: not this check's business


# Gemma 3: the tokens of one image attend to each other both ways during prefill (app/core/runner/image_groups.py)


@pytest.fixture(scope="module")
def gemma3():
    vlm, processor = build("gemma3")
    tok = processor.tokenizer
    lm = LoadedModel(model=text_model(vlm), tokenizer=tok, name="gemma3", max_context=512, eos_ids=(tok.eos_token_id,),
                     vision=VisionEncoder(vlm, processor, torch.float32))
    return vlm, processor, lm


def test_gemma3s_packed_mask_is_the_one_its_forward_builds_on_full_and_sliding_layers(gemma3):
    """The packed pass's mask for a prompt with an image is the one Gemma 3's forward builds from token_type_ids:
    causal OR same image on full-attention layers, the window AND that on sliding ones (an image of 16 tokens is
    longer than the window of 8: the window still cuts its far past), and it is not the causal mask."""
    from transformers.models.gemma3.modeling_gemma3 import (create_masks_for_vision_model,
                                                            get_block_sequence_ids_for_mask)

    from app.core.runner.packed import PackedCaches

    vlm, processor, lm = gemma3
    prompt, images = chat(lm.tokenizer, "compare them", images=2), [picture(1), picture(2)]
    inputs = processor(text=[prompt], images=[images], return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    theirs = create_masks_for_vision_model(config=vlm.config.text_config, inputs_embeds=torch.zeros(1, n, 64),
                                           attention_mask=None, cache=None, position_ids=torch.arange(n)[None],
                                           block_sequence_ids=get_block_sequence_ids_for_mask(inputs["token_type_ids"]))
    _, image_prompt = lm.vision.encode(prompt, images, ["a", "b"], max_image_tokens=10_000)
    assert len(image_prompt.groups) == 2 and all(b - a == 16 for a, b in image_prompt.groups)
    step = PackedCaches([], [(0, n)], torch.device("cpu"), groups=[image_prompt.groups_in(0, n)])
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for kind, window in (("full_attention", None), ("sliding_attention", 8)):
        ours = step.chunk_mask(n, n, window, step.groups[0])
        assert torch.equal(ours, theirs[kind]), kind
        assert not torch.equal(ours[0, 0], causal & ~causal.tril(-window if window else -n))


def test_a_prefill_chunk_ends_before_an_image_it_would_cut_or_past_it_when_the_image_starts_it():
    """Chunks never split an image's tokens (a query could not see the keys not fed yet): the chunk ends before the
    image, within the step's budget; where the image starts the chunk, it takes all of it, over the budget, so an
    image longer than the budget still moves on. Under BATCH_INVARIANT the end is also a multiple of 16."""
    from app.core.engine.step import keep_groups_whole

    runs = ((7, 23), (30, 46))  # two images' tokens, in a prompt of 60
    assert keep_groups_whole(5, 0, 60, runs) == 5  # cuts nothing
    assert keep_groups_whole(12, 0, 60, runs) == 7  # would end inside the first: ends before it
    assert keep_groups_whole(5, 7, 60, runs) == 16  # the first starts the chunk: all of it
    assert keep_groups_whole(40, 0, 60, runs) == 30  # ends before the second
    assert keep_groups_whole(60, 0, 60, runs) == 60
    assert keep_groups_whole(16, 0, 60, runs, piece=16) == 48  # 16 and 32 are inside images: past both, to 48
    assert keep_groups_whole(40, 0, 60, runs, piece=16) == 48
    assert keep_groups_whole(50, 10, 60, runs, piece=16) == 50  # the prompt's end needs no piece


@pytest.mark.parametrize("invariant", [False, True], ids=["packed", "batch-invariant"])
def test_gemma3_gets_generates_tokens_where_a_causal_mask_would_not_in_every_pass_and_chunking(gemma3, invariant):
    """One image and two images, alone (the solo pass, HF's own masks) and amid text requests (the packed pass),
    with the whole prompt in one step and in steps of 5 or 12 tokens, which would cut the images (16 tokens at
    prompt positions 7 to 23); under BATCH_INVARIANT, in 16-token pieces whose keys run on to their image's end."""
    import dataclasses

    vlm, processor, lm = gemma3
    lm = dataclasses.replace(lm, batch_invariant=invariant)
    one, two = chat(lm.tokenizer, "what is in this picture?"), chat(lm.tokenizer, "compare them", images=2)
    red, blue = picture(1), picture(2, size=(60, 30))
    want = [reference(vlm, processor, one, [blue]), reference(vlm, processor, two, [red, blue])]
    for prompt, images, tokens in ((one, [blue], want[0]), (two, [red, blue], want[1])):
        inputs = processor(text=[prompt], images=[images], return_tensors="pt")
        causal = {k: v for k, v in inputs.items() if k != "token_type_ids"}  # generate() then masks causally
        out = vlm.generate(**causal, max_new_tokens=GREEDY.max_tokens, do_sample=False)
        assert out[0, inputs["input_ids"].shape[1]:].tolist() != tokens  # a causal pass could not pass this test
    images = [request(lm, one, [blue], ["blue"]), request(lm, two, [red, blue], ["red", "blue"])]
    assert images[0][2].groups == ((7, 23),)
    text = [(lm.tokenizer.encode(t), GREEDY) for t in ("hello there", "a longer text-only prompt")]
    for budget in (None, 5, 12):
        for image, tokens in zip(images, want):
            (alone,), _ = run_engine(lm, [image], prefix_cache_bytes=0, prefill_tokens_per_step=budget)
            assert alone.tokens == tokens, budget
        seen, _ = run_engine(lm, [text[0], *images, text[1]], together=True, prefix_cache_bytes=0,
                             prefill_tokens_per_step=budget)
        assert [s.tokens for s in seen[1:3]] == want, budget
