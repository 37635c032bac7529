"""LoRA adapters per request on the tiny model: adapters made with peft (random non-zero weights), served through
our engine, held to peft's merged model's `generate()` in fp32, alone and batched with the base and each other;
the checks that refuse a bad adapter; and the prefix cache kept apart per adapter."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from app.core.engine.engine import Engine
from app.core.sampling import SamplingParams
from app.errors import InvalidRequest, ModelNotFound
from app.models.loading import LoadedModel
from app.config import parse_lora_modules
from app.models.lora import LoraAdapters
from conftest import build_tiny_model

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["The capital of France is", "def reverse(s):", "Emoji are fun:"]
N_TOKENS = 12


def make_adapter(vocab: int, path, seed: int, targets: list[str], r: int = 4, alpha: int = 8, **extra):
    """Save a peft LoRA adapter of the tiny model with random non-zero A and B; return peft's merged model."""
    base = build_tiny_model(vocab)
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **extra)
    peft_model = get_peft_model(base, config)
    with torch.no_grad():  # peft's own non-zero init is small next to the tiny model's weights: make it matter
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.3)
    peft_model.save_pretrained(path)
    return peft_model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_tokenizer):
    """Two adapters (all linears at rank 4; attention only at rank 8 with rsLoRA), and their merged models."""
    root, vocab = tmp_path_factory.mktemp("loras"), len(tiny_tokenizer)
    merged = {"alpha": make_adapter(vocab, root / "alpha", 1, ALL_LINEARS),
              "beta": make_adapter(vocab, root / "beta", 2, ["q_proj", "v_proj"], r=8, alpha=16, use_rslora=True)}
    return {"alpha": str(root / "alpha"), "beta": str(root / "beta")}, merged


def fresh_lm(tokenizer) -> LoadedModel:
    """The tiny model of its own: LoRA wraps its linears, which the session's shared one must not see."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return LoadedModel(model=build_tiny_model(len(tokenizer)), tokenizer=tokenizer, name="tiny", max_context=256,
                       eos_ids=(im_end,))


def reference(model, ids: list[int], n: int = N_TOKENS, eos_ids: tuple[int, ...] = (2,)) -> list[int]:
    """HF's greedy tokens, up to n or the first end token (which counts, as our last event carries it); eos 2 is
    the tiny tokenizer's <|im_end|>."""
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=n, eos_token_id=list(eos_ids), pad_token_id=0,
                         repetition_penalty=1.0)
    return out[0, len(ids):].tolist()


def serve(lm, registry, requests: list[tuple[list[int], str | None]], together: bool = True, n: int = N_TOKENS,
          **engine_kwargs) -> tuple[list[list[int]], list[int], Engine]:
    """Greedy tokens and cached prompt tokens of each (prompt, adapter name or None) through a real Engine."""
    engine = Engine(lm, adapters=registry, speculative="off", **engine_kwargs)
    params = SamplingParams(max_tokens=n, do_sample=False)

    async def one(ids, name):
        handle = engine.submit(ids, params, adapter=registry.get(name) if name else None)
        tokens = [event.token_id async for event in handle]
        return tokens, handle.cached_tokens

    async def main():
        engine.start()
        await asyncio.to_thread(engine.loaded.wait)
        if engine.load_error is not None:
            raise engine.load_error
        try:
            if together:
                return list(await asyncio.gather(*(one(ids, name) for ids, name in requests)))
            return [await one(ids, name) for ids, name in requests]
        finally:
            engine.stop()

    seen = asyncio.run(main())
    return [tokens for tokens, _ in seen], [cached for _, cached in seen], engine


def test_an_adapters_greedy_tokens_equal_peft_merged_models_generate(tiny_tokenizer, adapters):
    paths, merged = adapters
    lm = fresh_lm(tiny_tokenizer)
    ids = lm.encode_text(PROMPTS[0])
    for name in ("alpha", "beta"):
        tokens, _, _ = serve(lm, LoraAdapters("tiny", paths), [(ids, name)])
        assert tokens == [reference(merged[name], ids)]
    assert reference(merged["alpha"], ids) != reference(lm.model, ids)  # the adapter changes the answer


def test_base_and_two_adapters_in_one_batch_each_equal_their_own_reference(tiny_tokenizer, adapters):
    paths, merged = adapters
    lm = fresh_lm(tiny_tokenizer)
    registry = LoraAdapters("tiny", paths)
    requests = [(lm.encode_text(p), name) for p in PROMPTS for name in (None, "alpha", "beta")]
    tokens, _, engine = serve(lm, registry, requests, together=True)
    assert engine.batch_decode  # they did share passes
    expected = [reference(merged[name] if name else build_tiny_model(len(tiny_tokenizer)), ids)
                for ids, name in requests]
    assert tokens == expected
    assert len({tuple(t) for t, (_, name) in zip(tokens, requests) if name is None}
               | {tuple(t) for t, (_, name) in zip(tokens, requests) if name == "alpha"}) > len(PROMPTS)


def test_with_speculation_an_adapter_still_equals_its_reference(tiny_tokenizer, adapters):
    """Drafts are verified by the same model and adapter, so speculation keeps the adapter's tokens."""
    paths, merged = adapters
    lm = fresh_lm(tiny_tokenizer)
    ids = lm.encode_text("ab ab ab ab ab ab ab ab")  # repetitive: the n-gram drafter proposes
    engine = Engine(lm, adapters=LoraAdapters("tiny", paths), speculative="ngram")
    params = SamplingParams(max_tokens=N_TOKENS, do_sample=False)

    async def main():
        engine.start()
        await asyncio.to_thread(engine.loaded.wait)
        try:
            handle = engine.submit(ids, params, adapter=engine.adapters.get("alpha"))
            return [event.token_id async for event in handle]
        finally:
            engine.stop()

    assert asyncio.run(main()) == reference(merged["alpha"], ids)
    assert engine.metrics.draft_tokens._value.get() > 0  # drafts were verified under the adapter


def test_the_same_prompt_under_another_adapter_reuses_none_of_its_prefix_cache(tiny_tokenizer, adapters):
    paths, merged = adapters
    lm = fresh_lm(tiny_tokenizer)
    ids = lm.encode_text(" ".join(PROMPTS * 3))  # several prefix-cache blocks
    order = ["alpha", "beta", None, "alpha"]
    tokens, cached, engine = serve(lm, LoraAdapters("tiny", paths), [(ids, name) for name in order],
                                   together=False, prefix_cache_bytes=1 << 20)
    block = engine.prefix_cache.block_size
    assert cached == [0, 0, 0, (len(ids) - 1) // block * block]  # only the same adapter hits
    base = build_tiny_model(len(tiny_tokenizer))
    assert tokens == [reference(merged[name] if name else base, ids) for name in order]


def test_an_adapter_unloaded_mid_request_lets_the_request_finish(tiny_tokenizer, adapters):
    paths, merged = adapters
    lm = fresh_lm(tiny_tokenizer)
    registry = LoraAdapters("tiny", paths)
    engine = Engine(lm, adapters=registry, speculative="off")
    ids = lm.encode_text(PROMPTS[1])

    async def main():
        engine.start()
        await asyncio.to_thread(engine.loaded.wait)
        try:
            handle = engine.submit(ids, SamplingParams(max_tokens=N_TOKENS, do_sample=False),
                                   adapter=registry.get("alpha"))
            tokens = []
            async for event in handle:
                if not tokens:
                    registry.unload("alpha")
                tokens.append(event.token_id)
            return tokens
        finally:
            engine.stop()

    assert asyncio.run(main()) == reference(merged["alpha"], ids)
    assert registry.get("alpha") is None


# ---- what a bad adapter gets ----

def attached(tiny_tokenizer, **kwargs) -> LoraAdapters:
    registry = LoraAdapters("tiny", **kwargs)
    registry.attach(fresh_lm(tiny_tokenizer).model)
    return registry


def test_a_bad_adapter_is_refused_with_its_problem_named_and_nothing_loaded_changes(tiny_tokenizer, adapters,
                                                                                    tmp_path):
    paths, _ = adapters
    registry = attached(tiny_tokenizer, max_rank=4)
    kept = registry.load("alpha", paths["alpha"])
    (tmp_path / "empty").mkdir()
    wide = tmp_path / "wide"  # alpha's files with q_proj's A for a model twice as wide
    wide.mkdir()
    (wide / "adapter_config.json").write_text(open(f"{paths['alpha']}/adapter_config.json").read())
    tensors = load_file(f"{paths['alpha']}/adapter_model.safetensors")
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key] = torch.zeros(4, 128)
    save_file(tensors, str(wide / "adapter_model.safetensors"))
    cases = {str(tmp_path / "nowhere"): "does not exist", str(tmp_path / "empty"): "not a peft adapter",
             str(wide): "does not fit this base model", paths["beta"]: "rank 8, above MAX_LORA_RANK=4"}
    for path, problem in cases.items():
        with pytest.raises(InvalidRequest, match=problem) as err:
            registry.load("gamma", path)
        assert err.value.param == "lora_path"
    with pytest.raises(InvalidRequest, match="already loaded"):
        registry.load("alpha", paths["alpha"])
    assert registry.loaded() == [kept] and registry.get("gamma") is None
    with pytest.raises(ModelNotFound, match="'gamma'"):
        registry.unload("gamma")


def test_max_loras_bounds_the_resident_adapters(tiny_tokenizer, adapters):
    paths, _ = adapters
    registry = attached(tiny_tokenizer, max_loras=1)
    registry.load("alpha", paths["alpha"])
    with pytest.raises(InvalidRequest, match="MAX_LORAS=1"):
        registry.load("beta", paths["beta"])
    registry.unload("alpha")
    assert registry.load("beta", paths["beta"]).scale == pytest.approx(16 / math.sqrt(8))  # rsLoRA's scale


def test_peft_options_this_loop_does_not_apply_are_refused(tiny_tokenizer, adapters, tmp_path):
    paths, _ = adapters
    config = json.loads(open(f"{paths['alpha']}/adapter_config.json").read())
    (tmp_path / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    (tmp_path / "adapter_model.safetensors").write_bytes(open(f"{paths['alpha']}/adapter_model.safetensors",
                                                              "rb").read())
    with pytest.raises(InvalidRequest, match="use_dora"):
        attached(tiny_tokenizer).load("dora", str(tmp_path))


def test_lora_modules_parse_as_name_equals_path():
    assert parse_lora_modules(" a=/x/a , b=/y/b,") == {"a": "/x/a", "b": "/y/b"}
    for bad in ("a", "=/x", "a=/x,a=/y"):
        with pytest.raises(ValueError):
            parse_lora_modules(bad)


def test_with_int8_weights_an_adapter_moves_the_logits_to_its_merged_models(tiny_dir, tiny_tokenizer, adapters):
    """QUANT=int8 replaces every linear; the adapter wraps those. Not exact (int8 rounds), so the check is that the
    adapter's logits land near peft's fp32 merged model's, far nearer than the base's are."""
    from app.core.runner.forward import forward
    from app.core.runner.packed import enable_packed_batching
    from app.core.sequence import Sequence
    from app.models.loading import load_model

    paths, merged = adapters
    lm = load_model(str(tiny_dir), device="cpu", quant="int8")
    assert enable_packed_batching(lm.model)
    registry = LoraAdapters("tiny", paths)
    registry.attach(lm.model)
    ids = lm.encode_text(PROMPTS[1])
    rows = []
    for name in (None, "alpha"):
        seq = Sequence(lm.model, lm.tokenizer, ids, SamplingParams(max_tokens=1), lm.eos_ids, lm.max_context)
        seq.adapter = registry.get(name) if name else None
        rows.append((seq, len(ids)))
    base_int8, alpha_int8 = forward(lm.model, rows)  # base and adapter in one packed pass
    with torch.no_grad():
        alpha_fp32 = merged["alpha"](torch.tensor([ids])).logits[0, -1]
        base_fp32 = build_tiny_model(len(tiny_tokenizer))(torch.tensor([ids])).logits[0, -1]
    effect = (alpha_fp32 - base_fp32).abs().max()
    assert (alpha_int8 - alpha_fp32).abs().max() < 0.2 * effect
    assert (base_int8 - base_fp32).abs().max() < 0.2 * effect  # the base row got no adapter


def test_an_adapters_rows_spread_apart_in_a_pass_get_the_same_logits_as_side_by_side(tiny_tokenizer, adapters):
    """The engine puts an adapter's rows side by side (one slice); rows spread apart are gathered instead. Both
    give each row its own logits: those of the row alone, within batching's rounding."""
    from app.core.runner.forward import forward
    from app.core.runner.packed import enable_packed_batching
    from app.core.sequence import Sequence

    paths, _ = adapters
    lm = fresh_lm(tiny_tokenizer)
    assert enable_packed_batching(lm.model)
    registry = LoraAdapters("tiny", paths)
    registry.attach(lm.model)

    def row(name, text):
        ids = lm.encode_text(text)
        seq = Sequence(lm.model, lm.tokenizer, ids, SamplingParams(max_tokens=1), lm.eos_ids, lm.max_context)
        seq.adapter = registry.get(name) if name else None
        return seq, len(ids)

    names = ["alpha", None, "alpha", "beta", "alpha"]
    together = forward(lm.model, [row(name, PROMPTS[i % 3]) for i, name in enumerate(names)])
    alone = torch.cat([forward(lm.model, [row(name, PROMPTS[i % 3])]) for i, name in enumerate(names)])
    assert torch.allclose(together, alone, atol=1e-4)
    assert not torch.allclose(together[0], forward(lm.model, [row(None, PROMPTS[0])])[0], atol=1e-2)


def test_a_bad_start_up_adapter_fails_the_start_naming_it(tiny_tokenizer, tmp_path):
    engine = Engine(fresh_lm(tiny_tokenizer), adapters=LoraAdapters("tiny", {"sql": str(tmp_path / "missing")}))
    engine.start()
    engine.loaded.wait(60)
    assert isinstance(engine.load_error, InvalidRequest) and "'sql'" in engine.load_error.message
    assert "does not exist" in engine.load_error.message
