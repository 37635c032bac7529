"""Images in: a vision-language model served as its language model, with its images turned into embeddings first.

A VLM such as LLaVA is a causal language model whose prompt has placeholder tokens where an image goes: its forward
runs the vision tower and projector on the pixels (`get_image_features`), embeds the prompt, and writes the image
features over the placeholders' embeddings (`masked_scatter`) before the language model runs. Everything after that
is text generation, so the server splits the model there:
- the engine serves the language model alone, as a `*ForCausalLM` sharing the VLM's modules (`text_model`): every
  path it has (packed batching, prefix cache, prepacking, the compiled step) sees the text model it knows;
- a request's images are encoded once, before the engine (`VisionEncoder.encode`, on a prepare worker, never on the
  event loop): the processor's own preprocessing and placeholder expansion, then the vision tower. What comes out,
  `ImagePrompt`, rides with the request: the prompt positions of its placeholders and their embeddings, which the
  pass writes over those positions' token embeddings (app/core/runner/forward.py), exactly as the VLM's forward does.

Qwen2-VL's family places tokens with 3 rotary positions each (M-RoPE: an image's tokens on a time x height x
width grid, the text after it going on from the grid's largest position): the model's own `get_rope_index` places
a prompt once, at encode, and the pass feeds those positions (`ImagePrompt.rope`, app/core/runner/forward.py); later
tokens sit at their index + `rope_delta`, as generate() places them. Qwen3-VL adds deepstack: features of earlier
vision layers added to the first decoder layers' outputs at the placeholders (`ImagePrompt.deepstack`, which the
pass hands the text model as its `visual_pos_masks` and `deepstack_visual_embeds`). Where a family needs more, the
packed path would not be exact, so it is refused at start (`UNSERVED`).

The prefix cache keys a prompt by its token ids, and every image's placeholders are the same ids: `ImagePrompt.keys`
puts each image's digest (of its decoded pixels) in place of its placeholders, so the same image reuses its KV and a
different one never does.

Served families (tests/vision_models.py builds each, tests/fast/test_vision.py checks generate's tokens): LLaVA,
LLaVA-NeXT and LLaVA-OneVision (anyres tiles; their learned row-newline embeddings are image tokens, which
`get_image_features` returns packed in the prompt's order), Mistral 3 (Pixtral: row-break tokens between an image's
rows, so several placeholder runs per image), Idefics3 (SmolVLM's architecture: tiles behind row/col tags), InternVL,
Qwen2-VL, Qwen2.5-VL and Qwen3-VL (M-RoPE; Qwen3-VL's deepstack), Gemma 3 (an image's tokens see each
other both ways in prefill: app/core/runner/image_groups.py).

torchvision is not installed here, and some processors want it: those that also take video (LLaVA-OneVision's,
InternVL's) check for a video processor that needs it, and Pixtral's imports a helper from its torchvision image
processor's module. `processor_class` gives classes built without it, and where `AutoProcessor` fails,
`load_processor` builds the processor as `from_pretrained` would, with the Pillow image processor
(`*ImageProcessorPil`) and no video processor.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import torch

from app.errors import InvalidRequest

log = logging.getLogger("app.models.vision")

# model_type -> why the packed path would not serve it exactly (a sentence naming what it has)
UNSERVED = {
    "qwen3_vl_moe": "deepstack (image features added into the first decoder layers' hidden states)",
    "gemma3n": "per-layer input embeddings looked up from the prompt's token ids beside its embeddings",
}
# model types whose image tokens attend to each other both ways during prefill: each run of consecutive placeholders
# is one group, as Gemma 3's forward groups them (`token_type_ids` runs); the pass masks them so
# (app/core/runner/image_groups.py)
BIDIRECTIONAL = {"gemma3"}


def is_vision(config) -> bool:
    """Whether this config is a vision-language model's (a vision tower beside a text decoder)."""
    return getattr(config, "vision_config", None) is not None and getattr(config, "text_config", None) is not None


def unserved_vision(config) -> str | None:
    """Why this vision-language model cannot be served exactly, or None."""
    why = UNSERVED.get(config.model_type)
    if why is not None:
        return (f"{config.model_type} has {why}, which the packed batch path does not serve exactly; vision models "
                "served: those whose language model takes 1-D or M-RoPE positions and a causal mask, or Gemma 3's "
                "image runs")
    if image_token_id(config) is None:
        return f"{config.model_type} names no image token id in its config"
    return None


def image_token_id(config) -> int | None:
    for name in ("image_token_id", "image_token_index"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    return None


@dataclass
class ImagePrompt:
    """What a request's images became: where their placeholders sit in the prompt, and what goes there."""

    positions: torch.Tensor  # [n_image_tokens] long, ascending: prompt indices of the placeholder tokens
    embeds: torch.Tensor  # [n_image_tokens, hidden] in the model's dtype, in the positions' order
    owners: list[str]  # [n_image_tokens]: the digest of the image each placeholder belongs to
    # M-RoPE (Qwen2-VL's family): each prompt token's 3 rotary positions (time, height, width) [3, prompt_len], and
    # how far the positions after the prompt are from the token index (the images took fewer positions than tokens)
    rope: torch.Tensor | None = None
    rope_delta: int = 0
    # deepstack (Qwen3-VL): per decoder layer it reaches, [n_image_tokens, hidden] added to that layer's output
    # at the placeholders' positions
    deepstack: list[torch.Tensor] | None = None
    # BIDIRECTIONAL families: each group of placeholders that attend to each other both ways, as prompt positions
    # (first, end); empty where the family's attention is causal
    groups: tuple[tuple[int, int], ...] = ()

    def __len__(self) -> int:
        return len(self.positions)

    def keys(self, prompt_ids: Sequence[int]) -> list[Hashable]:
        """The prompt as the prefix cache keys it: each placeholder replaced by (its image's digest, its index in
        that image), so two prompts share a block only where their images' pixels are the same."""
        keys: list[Hashable] = list(prompt_ids)
        seen: dict[str, int] = {}
        for position, owner in zip(self.positions.tolist(), self.owners):
            index = seen[owner] = seen.get(owner, -1) + 1
            keys[position] = (owner, index)
        return keys

    def rope_positions(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start]: the rotary positions of token indices [start, end): the prompt's as the model placed
        them, and each later token at its index + rope_delta, as HF's generate() places it."""
        prompt_len = self.rope.shape[1]
        later = torch.arange(max(start, prompt_len), max(end, prompt_len)) + self.rope_delta
        return torch.cat([self.rope[:, start:min(end, prompt_len)], later.expand(3, -1)], dim=1)

    def groups_in(self, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """The groups among prompt positions [start, end) (or reaching into them), as offsets from `start`."""
        return tuple((a - start, b - start) for a, b in self.groups if a < end and b > start)

    def chunk(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor] | None]:
        """The placeholders among prompt positions [start, end): (their offsets from `start`, their embeddings,
        their deepstack embeddings per layer or None)."""
        inside = (self.positions >= start) & (self.positions < end)
        deep = [layer[inside] for layer in self.deepstack] if self.deepstack is not None else None
        return self.positions[inside] - start, self.embeds[inside], deep


class VisionEncoder:
    """A loaded VLM's image side: the processor, and the vision tower with its projector (the VLM's own modules)."""

    def __init__(self, vlm, processor, dtype: torch.dtype):
        self.vlm, self.processor, self.dtype = vlm, processor, dtype
        self.image_token_id = image_token_id(vlm.config)
        # the processor's outputs that get_image_features takes (pixel_values, image_sizes, pixel_attention_mask...)
        self._feature_args = set(inspect.signature(vlm.model.get_image_features).parameters)
        # M-RoPE: the model places a prompt's tokens itself (get_rope_index), from the processor's outputs
        rope_index = getattr(vlm.model, "get_rope_index", None)
        self._rope_index = rope_index
        self._rope_args = set(inspect.signature(rope_index).parameters) - {"input_ids"} if rope_index else set()

    def encode(self, prompt: str, images: Sequence[Any], digests: Sequence[str],
               max_image_tokens: int) -> tuple[list[int], ImagePrompt]:
        """A rendered chat prompt (one placeholder per image, as the chat template wrote it) and its images, in
        order -> the prompt's token ids with each placeholder expanded as the processor does, and the images'
        embeddings. The vision tower runs here: on the caller's thread, never the event loop's."""
        # one prompt's images, nested as HF's apply_chat_template passes them: LLaVA-OneVision tiles a lone image
        # (anyres) but not one among several, which it can tell only from the nesting
        inputs = self.processor(text=[prompt], images=[list(images)], return_tensors="pt")
        ids = inputs.pop("input_ids")[0]
        positions = (ids == self.image_token_id).nonzero()[:, 0]
        if len(positions) > max_image_tokens:
            raise InvalidRequest(f"the images take {len(positions)} tokens; this server takes at most "
                                 f"{max_image_tokens} image tokens per request (MAX_IMAGE_TOKENS)", param="messages")
        pixels = {k: v for k, v in inputs.items() if k in self._feature_args}
        device = self.vlm.device  # the processor's tensors are on the CPU
        pixels = {k: v.to(device, self.dtype) if v.is_floating_point() else v.to(device) for k, v in pixels.items()}
        with torch.inference_mode():
            out = self.vlm.model.get_image_features(**pixels, return_dict=True)
        embeds = torch.cat([f.reshape(-1, f.shape[-1]) for f in out.pooler_output]).to(self.dtype)
        if len(embeds) != len(positions):
            raise InvalidRequest(f"the prompt has {len(positions)} image placeholder tokens but its images gave "
                                 f"{len(embeds)} features; write no image token in the text", param="messages")
        image_prompt = ImagePrompt(positions, embeds, _owners(ids, positions, digests))
        if self.vlm.config.model_type in BIDIRECTIONAL:
            image_prompt.groups = _runs(positions)
        if (deep := getattr(out, "deepstack_features", None)) is not None:  # per layer, per image
            image_prompt.deepstack = [torch.cat(list(layer)).to(self.dtype) for layer in deep]
        if self._rope_index is not None:
            rope_inputs = {k: v.to(self.vlm.device) for k, v in inputs.items() if k in self._rope_args}
            rope, delta = self._rope_index(ids[None].to(self.vlm.device), **rope_inputs)  # [3, 1, n], [1, 1]
            image_prompt.rope, image_prompt.rope_delta = rope[:, 0].cpu(), int(delta.reshape(-1)[0])
        return ids.tolist(), image_prompt


def _runs(positions: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """Each run of consecutive placeholder positions, as (first, end)."""
    breaks = (positions[1:] != positions[:-1] + 1).nonzero()[:, 0].tolist()
    firsts, lasts = [0] + [b + 1 for b in breaks], breaks + [len(positions) - 1]
    return tuple((int(positions[f]), int(positions[l]) + 1) for f, l in zip(firsts, lasts)) if len(positions) else ()


def _owners(ids: torch.Tensor, positions: torch.Tensor, digests: Sequence[str]) -> list[str]:
    """Each placeholder's image: the images' placeholders come in the images' order, split evenly when each image
    takes the same count (a fixed-size family), else one run of consecutive placeholders per image."""
    n = len(positions)
    if not digests or not n:
        return []
    runs = (positions[1:] != positions[:-1] + 1).nonzero()[:, 0].tolist()
    starts = [0] + [r + 1 for r in runs]
    if len(starts) == len(digests):  # one run per image
        ends = starts[1:] + [n]
        return [d for d, s, e in zip(digests, starts, ends) for _ in range(e - s)]
    # several runs per image (tiles, rows): images in order; the whole set keys each placeholder, which is exact
    # (a different image anywhere changes every key) though it shares less between prompts with common images
    whole = "+".join(digests)
    return [whole] * n


def text_model(vlm) -> torch.nn.Module:
    """The VLM's language half as a `*ForCausalLM`: its own decoder and lm_head, no copies."""
    from transformers import AutoModelForCausalLM

    text_config = vlm.config.get_text_config(decoder=True)
    with torch.device("meta"):
        if text_config.model_type in _SHELLED:
            lm = _shell(text_config)
        else:
            lm = AutoModelForCausalLM.from_config(text_config, dtype=vlm.dtype)
    lm.model = vlm.get_decoder()  # `language_model` in most families, `text_model` in Idefics3's
    lm.lm_head = vlm.lm_head
    lm.generation_config = vlm.generation_config
    return lm.eval()


# text model types transformers maps to no *ForCausalLM (Qwen2-VL's family): held by `_shell`
_SHELLED = {"qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text"}


def _shell(text_config):
    """A *ForCausalLM with no layers of its own, given the text model's config: only its `model`, `lm_head` and
    `config` are ever used, and the caller puts the VLM's decoder and lm_head in it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    lm = Qwen2ForCausalLM(Qwen2Config(vocab_size=1, hidden_size=8, intermediate_size=8, num_hidden_layers=0,
                                      num_attention_heads=1, num_key_value_heads=1))
    lm.config = text_config
    return lm


def processor_class(name: str):
    """The processor class `name`, as it can be built without torchvision:
    - Pixtral's processor module (Mistral 3's) imports one helper, for token counts, from its torchvision image
      processor's module; the Pillow module defines the same function, so it stands in for that module while the
      processor's module is imported, and only then;
    - a processor that also takes video (LLaVA-OneVision's, InternVL's) checks its video processor against a class
      that needs torchvision: the class returned takes None there (this server takes images, never video)."""
    import importlib
    import sys

    from transformers.models.auto.processing_auto import processor_class_from_name
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return processor_class_from_name(name)
    if (family := _TORCHVISION_HELPERS.get(name)) is not None:
        base = f"transformers.models.{family}"
        torchvision_module = f"{base}.image_processing_{family}"
        sys.modules[torchvision_module] = importlib.import_module(f"{base}.image_processing_pil_{family}")
        try:
            cls = getattr(importlib.import_module(f"{base}.processing_{family}"), name)
        finally:
            del sys.modules[torchvision_module]
    else:
        cls = processor_class_from_name(name)
    return _without_video(cls) if cls is not None and "video_processor" in cls.get_attributes() else cls


@functools.cache
def _without_video(cls):
    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return cls.check_argument_for_proper_class(self, argument_name, argument)

    return type(cls.__name__, (cls,), {"__module__": cls.__module__, "__doc__": cls.__doc__,
                                       "check_argument_for_proper_class": check_argument_for_proper_class})


# processor class -> the family whose torchvision image-processing module its processor module imports a helper from
_TORCHVISION_HELPERS = {"PixtralProcessor": "pixtral"}


def load_processor(source: str, kwargs: dict[str, Any], tokenizer):
    """The model's processor; where it cannot be built without torchvision (a video processor, a torchvision
    import), its class built as `from_pretrained` builds it, from its processor_config.json, with the Pillow image
    processor, the tokenizer, and no video processor."""
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    from transformers.processing_utils import ProcessorMixin

    try:
        return AutoProcessor.from_pretrained(source, **kwargs)
    except (ImportError, OSError, ValueError, TypeError) as err:
        log.info("processor built without torchvision (%s)", err)
    processor_dict, extra = ProcessorMixin.get_processor_dict(source, **kwargs)
    name = (processor_dict.get("processor_class")
            or PROCESSOR_MAPPING_NAMES.get(AutoConfig.from_pretrained(source, **kwargs).model_type))
    cls = processor_class(name) if name else None
    if cls is None or not issubclass(cls, ProcessorMixin):
        raise ValueError(f"no processor class ({name}) could be built without torchvision")
    parts = {"image_processor": AutoImageProcessor.from_pretrained(source, backend="pil", **kwargs),
             "tokenizer": tokenizer, "video_processor": None}
    if unknown := [a for a in cls.get_attributes() if a not in parts]:
        raise ValueError(f"{name} also takes {unknown}, which cannot be built here")
    return cls.from_args_and_dict([parts[a] for a in cls.get_attributes()], processor_dict, **extra)


def load_vision(source: str, kwargs: dict[str, Any], device: torch.device, dtype: torch.dtype, tokenizer):
    """(the text `*ForCausalLM` the engine serves, the VisionEncoder) of a vision-language checkpoint."""
    from transformers import AutoModelForImageTextToText

    vlm = AutoModelForImageTextToText.from_pretrained(source, dtype=dtype, device_map=device, **kwargs).eval()
    processor = load_processor(source, kwargs, tokenizer)
    if getattr(tokenizer, "chat_template", None) is None and getattr(processor, "chat_template", None):
        tokenizer.chat_template = processor.chat_template  # a VLM's template often ships beside its processor
    log.info("vision model %s: the engine serves its language model; images are encoded before the engine",
             vlm.config.model_type)
    return text_model(vlm), VisionEncoder(vlm, processor, dtype)


def vision_problem(config, quant: str, tensor_parallel: int) -> str | None:
    """Why this config cannot be served as a vision model with these settings (None: it can, or it is text)."""
    if not is_vision(config):
        return None
    if why := unserved_vision(config):
        return why
    if quant != "none":
        return f"QUANT={quant} is for text models; a vision model is served unquantized (QUANT=none)"
    if tensor_parallel > 1:
        return "a vision model runs on one device (TENSOR_PARALLEL=1)"
    return None
