"""Tiny random vision-language models of real architectures, each with its real processor class (Pillow image
processors, no torchvision), built offline in seconds: for the tests that serve images (tests/fast/test_vision.py).

`build(family)` returns (the VLM in fp32 eval mode, its processor); the tokenizer is the tests' tiny byte-level BPE
with the family's image tokens added, and a chat template that writes one image token per `{"type": "image"}` part,
as the families' own templates do. As in tests/arch_models.py, the output layer is sharpened so greedy ties cannot
make comparisons flaky. Processors that want torchvision (a video processor, Pixtral's import) come from
`app.models.vision.processor_class`, as the server builds them.

Not here: SmolVLM (Idefics3's architecture, which is here) has a processor that needs `num2words`, not installed."""

from __future__ import annotations

import torch

from app.models.vision import processor_class
from conftest import build_tiny_tokenizer

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for c in m.content %}{% if c.type == 'image' %}IMAGE{% else %}{{ c.text }}{% endif %}{% endfor %}"
            "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer(image_token: str, *others: str):
    """`others`: the family's other image-layout tokens (row breaks, image start/end), added after the image's."""
    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [image_token, *others]})
    tok.chat_template = TEMPLATE.replace("IMAGE", image_token)
    return tok


def _sharpen(vlm):
    torch.manual_seed(0)
    with torch.no_grad():
        vlm.lm_head.weight.mul_(8)
    return vlm.eval()


def _llava():
    import transformers as tf
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = _tokenizer("<image>")
    config = tf.LlavaConfig(
        vision_config=tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32),
        text_config=tf.LlamaConfig(vocab_size=len(tok), **TEXT), image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2, vision_feature_select_strategy="default")
    images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = tf.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=8, image_token="<image>",
                                  vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                  chat_template=tok.chat_template)
    torch.manual_seed(0)
    return _sharpen(tf.LlavaForConditionalGeneration(config)), processor


def _mistral3():
    """Pixtral's vision tower (2x2 patch merge): a row-break token after each row of an image's tokens and an end
    token after the last, so an image takes several placeholder runs."""
    import transformers as tf
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    tok = _tokenizer("[IMG]", "[IMG_BREAK]", "[IMG_END]")
    config = tf.Mistral3Config(
        vision_config=tf.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, head_dim=16, image_size=32, patch_size=8),
        # no sliding window, as Mistral Small 3.1 has none (one would turn the prefix cache off)
        text_config=tf.MistralConfig(vocab_size=len(tok), sliding_window=None, **TEXT),
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2, vision_feature_layer=-1,
        tie_word_embeddings=False)  # tied by default: sharpening lm_head would scale the embeddings too
    # longest edge 32 in 16-pixel steps: an image is 1x2 to 2x2 merged patches, a row break after each row
    images = PixtralImageProcessorPil(size={"longest_edge": 32}, patch_size={"height": 16, "width": 16})
    processor = processor_class("PixtralProcessor")(image_processor=images, tokenizer=tok, patch_size=8,
                                                    spatial_merge_size=2, chat_template=tok.chat_template)
    torch.manual_seed(0)
    return _sharpen(tf.Mistral3ForConditionalGeneration(config)), processor


def _idefics3():
    """SmolVLM's architecture, with image splitting on: an image is up to 2x2 tiles of 32 pixels and the whole image
    at 32, each tile 4 image tokens behind its own <row_i_col_j> tag (several placeholder runs per image)."""
    import transformers as tf
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tiles = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    tok = _tokenizer("<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>", *tiles)
    config = tf.Idefics3Config(
        vision_config=tf.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, image_size=32, patch_size=8),
        text_config=tf.LlamaConfig(vocab_size=len(tok), **TEXT), image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=2)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                       do_image_splitting=True)
    processor = tf.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4,
                                     chat_template=tok.chat_template)
    torch.manual_seed(0)
    return _sharpen(tf.Idefics3ForConditionalGeneration(config)), processor


def _llava_onevision():
    """A lone image is anyres: its 32-pixel base view, then its tiles (a 32 or 64 pixel grid) unpadded, with a
    learned newline embedding closing each row (image tokens too); an image among several is its base view."""
    import transformers as tf
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil)

    tok = _tokenizer("<image>", "<video>")
    grid = [[32, 32], [32, 64], [64, 32], [64, 64]]
    config = tf.LlavaOnevisionConfig(
        vision_config=tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, image_size=32, patch_size=8),
        text_config=tf.Qwen2Config(vocab_size=len(tok), **TEXT), image_token_index=tok.convert_tokens_to_ids("<image>"),
        video_token_index=tok.convert_tokens_to_ids("<video>"), image_grid_pinpoints=grid,
        vision_feature_select_strategy="full", vision_feature_layer=-1)
    images = LlavaOnevisionImageProcessorPil(size={"height": 32, "width": 32}, image_grid_pinpoints=grid)
    processor = processor_class("LlavaOnevisionProcessor")(
        image_processor=images, tokenizer=tok, video_processor=None, num_image_tokens=16,
        vision_feature_select_strategy="full", chat_template=tok.chat_template)
    torch.manual_seed(0)
    return _sharpen(tf.LlavaOnevisionForConditionalGeneration(config)), processor


def _internvl():
    """An image is cropped to up to 4 tiles of 32 pixels plus a thumbnail, each 4 image tokens (pixel shuffle),
    between <img> and </img>."""
    import transformers as tf
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    tok = _tokenizer("<IMG_CONTEXT>", "<img>", "</img>", "<video>")
    # what a real InternVL tokenizer_config.json's `extra_special_tokens` names, which its processor reads
    tok._set_model_specific_special_tokens({"context_image_token": "<IMG_CONTEXT>", "start_image_token": "<img>",
                                            "end_image_token": "</img>", "video_token": "<video>"})
    config = tf.InternVLConfig(
        vision_config=tf.InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, image_size=[32, 32], patch_size=[8, 8]),
        text_config=tf.Qwen2Config(vocab_size=len(tok), **TEXT),
        image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=4, downsample_ratio=0.5,
        tie_word_embeddings=False)
    images = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=True, min_patches=1,
                                      max_patches=4)
    processor = processor_class("InternVLProcessor")(image_processor=images, tokenizer=tok, video_processor=None,
                                                     image_seq_length=4, chat_template=tok.chat_template)
    torch.manual_seed(0)
    return _sharpen(tf.InternVLForConditionalGeneration(config)), processor


def _llava_next():
    """Anyres: an image's 32-pixel base view, then its tiles on the best of a 32/64 pixel grid, unpadded, with a
    learned newline embedding closing each row (image tokens too)."""
    import transformers as tf
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tok = _tokenizer("<image>")
    grid = [[32, 64], [64, 32], [64, 64]]
    config = tf.LlavaNextConfig(
        vision_config=tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32),
        text_config=tf.LlamaConfig(vocab_size=len(tok), **TEXT), image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_grid_pinpoints=grid, vision_feature_layer=-2, vision_feature_select_strategy="default")
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                        image_grid_pinpoints=grid)
    processor = tf.LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=8, image_token="<image>",
                                      vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                      chat_template=tok.chat_template)
    torch.manual_seed(0)
    return _sharpen(tf.LlavaNextForConditionalGeneration(config)), processor


def _qwen_vl(family: str):
    """M-RoPE: an image's tokens sit on a (time, height, width) grid of rotary positions and the text after it goes
    on from the grid's largest position, not from its token count (ImagePrompt.rope, rope_delta); Qwen2.5-VL's
    vision tower has windowed attention, Qwen2-VL's not. The template writes <|vision_start|><|image_pad|>
    <|vision_end|> for an image, as the families' own templates do."""
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = _tokenizer("<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>")
    tok.chat_template = TEMPLATE.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>")
    ids = tok.convert_tokens_to_ids
    text = dict(vocab_size=len(tok), **{k: v for k, v in TEXT.items() if k != "head_dim"},
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, num_heads=2, patch_size=8, spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen3_vl":  # deepstack: 2 vision layers' features added to the first 2 decoder layers' output
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}
        del text["rope_scaling"]
        vision |= dict(hidden_size=32, intermediate_size=64, out_hidden_size=64, num_position_embeddings=64,
                       deepstack_visual_indexes=[0, 1])
        config_class, model_class, processor_name = (tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration,
                                                     "Qwen3VLProcessor")
    elif family == "qwen2_5_vl":
        vision |= dict(hidden_size=32, intermediate_size=64, out_hidden_size=64, fullatt_block_indexes=[1],
                       window_size=32)
        config_class, model_class, processor_name = (tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration,
                                                     "Qwen2_5_VLProcessor")
    else:
        vision |= dict(embed_dim=32, mlp_ratio=2, hidden_size=64)  # Qwen2-VL: hidden_size is the merger's output
        config_class, model_class, processor_name = (tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration,
                                                     "Qwen2VLProcessor")
    config = config_class(text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
                          video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
                          vision_end_token_id=ids("<|vision_end|>"))
    images = Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=64 * 64, patch_size=8, merge_size=2,
                                      temporal_patch_size=2)
    processor = processor_class(processor_name)(image_processor=images, tokenizer=tok, video_processor=None,
                                                chat_template=tok.chat_template)
    torch.manual_seed(2)  # a seed whose tiny model answers two test pictures differently (seed 0's did not)
    return _sharpen(model_class(config)), processor


def _gemma3():
    """An image is 16 soft tokens (4x4 patches, no pooling) between <start_of_image> and <end_of_image>, which attend
    to each other both ways during prefill; sliding-window layers of 8, shorter than an image and than the prompts.
    Its projection starts at zeros (an image would change nothing): drawn at random here."""
    import transformers as tf
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = _tokenizer("<start_of_image>", "<image_soft_token>", "<end_of_image>")
    # what a real Gemma 3 tokenizer_config.json names, which its processor reads
    tok._set_model_specific_special_tokens({"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                                            "eoi_token": "<end_of_image>"})
    text = {k: v for k, v in TEXT.items() if k != "tie_word_embeddings"}
    config = tf.Gemma3Config(
        vision_config=tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, image_size=32, patch_size=8),
        text_config=tf.Gemma3TextConfig(vocab_size=len(tok), sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"], **text),
        mm_tokens_per_image=16, boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
        image_token_index=tok.image_token_id, tie_word_embeddings=False)
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = tf.Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=16,
                                   chat_template=tok.chat_template)
    torch.manual_seed(0)
    vlm = tf.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        vlm.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.2)
    return _sharpen(vlm), processor


FAMILIES = {"llava": _llava, "mistral3": _mistral3, "idefics3": _idefics3, "llava_onevision": _llava_onevision,
            "internvl": _internvl, "llava_next": _llava_next, "qwen2_5_vl": lambda: _qwen_vl("qwen2_5_vl"),
            "qwen2_vl": lambda: _qwen_vl("qwen2_vl"), "qwen3_vl": lambda: _qwen_vl("qwen3_vl"),
            "gemma3": _gemma3}


def build(family: str):
    return FAMILIES[family]()


def save_checkpoint(vlm, processor, path) -> None:
    """`path` laid out as a real checkpoint of the family is. A processor that also takes video cannot save itself
    here (it has no video processor: torchvision is not installed), so its parts are written as the hub's
    checkpoints of those families have them: preprocessor_config.json (the image processor),
    video_preprocessor_config.json (the video processor, which `AutoProcessor` then fails to build),
    processor_config.json (the processor's own settings), the tokenizer and chat template."""
    import json

    vlm.save_pretrained(path)
    if getattr(processor, "video_processor", False) is not None:
        processor.save_pretrained(path)
        return
    processor.image_processor.save_pretrained(path)
    processor.tokenizer.save_pretrained(path)
    settings = {k: v for k, v in processor.to_dict().items() if k not in ("image_processor", "video_processor")}
    (path / "processor_config.json").write_text(json.dumps(settings, indent=2))
    video = {"video_processor_type": type(processor).__name__.replace("Processor", "VideoProcessor"),
             "processor_class": type(processor).__name__, "size": {"height": 32, "width": 32}}
    (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
