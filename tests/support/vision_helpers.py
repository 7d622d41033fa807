"""Tiny random vision-language models with processors built locally (no download), and test images."""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path
from typing import Any

from helpers import smollm2_tokenizer

# A ChatML template that writes the processor's image placeholder for each image part.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _widen(model: Any) -> None:
    """Random init leaves logits nearly flat; a wider spread makes greedy choices clear-cut."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)


def _text_config(vocab: int) -> dict[str, Any]:
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                tie_word_embeddings=False)


def make_tiny_llava(path: Path, seed: int = 0, image_size: int = 48, patch: int = 8) -> Path:
    """A LLaVA (CLIP vision tower, projector, Llama decoder) with random weights and its LlavaProcessor:
    (image_size / patch)^2 image tokens per image."""
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tok = smollm2_tokenizer().__class__.from_pretrained(_tokenizer_copy(path.parent))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=image_size, patch_size=patch, projection_dim=32)
    cfg = LlavaConfig(vision_config=vision, text_config=LlamaConfig(**_text_config(len(tok))),
                      image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg)
    _widen(model)
    model.save_pretrained(path)
    images = CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=patch, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return path


def _tokenizer_copy(where: Path) -> Path:
    """SmolLM2's tokenizer saved to a folder, so each model gets its own instance to add tokens to."""
    out = where / "tokenizer-base"
    if not out.exists():
        smollm2_tokenizer().save_pretrained(out)
    return out


def random_image(rng: random.Random, width: int, height: int) -> Any:
    """A PIL image of random blocks of colour (structure a vision tower can tell apart)."""
    import numpy as np
    from PIL import Image

    small = np.random.RandomState(rng.randrange(2**31)).randint(0, 256, (max(height // 8, 1), max(width // 8, 1), 3))
    return Image.fromarray(small.astype(np.uint8)).resize((width, height), Image.NEAREST)


def image_bytes(image: Any, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def data_url(image: Any, fmt: str = "PNG") -> str:
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(image_bytes(image, fmt)).decode()


def make_tiny_idefics3(path: Path, seed: int = 0) -> Path:
    """An Idefics3 (SmolVLM's architecture: SigLIP-style tower, pixel-shuffle connector, Llama decoder) with
    random weights and its processor: images split into 32-pixel tiles plus a global view, 4 image tokens
    each, between row/column and <fake_token_around_image> tokens."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
        LlamaConfig,
    )

    tok = smollm2_tokenizer().__class__.from_pretrained(_tokenizer_copy(path.parent))
    tok.add_special_tokens({"additional_special_tokens": ["<image>", "<fake_token_around_image>", "<global-img>"]})
    tok.add_tokens([f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8)
    cfg = Idefics3Config(vision_config=vision, text_config=LlamaConfig(**_text_config(len(tok))).to_dict(),
                         image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(cfg)
    _widen(model)
    model.save_pretrained(path)
    images = Idefics3ImageProcessor(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                    do_image_splitting=True)
    Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4,
                      chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return path


# Qwen2-VL's chat template, cut down: each image part is <|vision_start|><|image_pad|><|vision_end|>.
QWEN_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")


def make_tiny_qwen2vl(path: Path, seed: int = 0, version: str = "2") -> Path:
    """A Qwen2-VL (``version`` "2") or Qwen2.5-VL ("2.5") with random weights and its processor: 8-pixel
    patches merged 2x2, so an image resized to W x H (multiples of 16) takes (W/16)(H/16) image tokens with
    2-D M-RoPE positions. The decoder's head (16 dims) splits its rotary frequencies 2/3/3 over t/h/w."""
    import torch
    from sluice.engine.vision_processor import images_only
    from transformers import AutoModelForImageTextToText, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = smollm2_tokenizer().__class__.from_pretrained(_tokenizer_copy(path.parent))
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                          "<|video_pad|>"]})
    ids = {name: tok.convert_tokens_to_ids(f"<|{name}|>") for name in ("vision_start", "vision_end", "image_pad",
                                                                       "video_pad")}
    text = dict(_text_config(len(tok)), rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "mrope_section": [2, 3, 3]})
    common = dict(depth=2, num_heads=2, patch_size=8, spatial_merge_size=2, temporal_patch_size=2)
    tokens = dict(image_token_id=ids["image_pad"], video_token_id=ids["video_pad"],
                  vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"])
    if version == "2":
        from transformers import Qwen2VLConfig

        cfg: Any = Qwen2VLConfig(text_config=text, vision_config=dict(common, embed_dim=32, hidden_size=64, mlp_ratio=2),
                                 **tokens)
    else:
        from transformers import Qwen2_5_VLConfig

        vision = dict(common, hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=32,
                      fullatt_block_indexes=[1])
        cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg)
    _widen(model)
    model.save_pretrained(path)
    images = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                                      size={"shortest_edge": 16 * 16, "longest_edge": 96 * 96})
    # Without torchvision there is no video processor (engine/vision_processor.py); Sluice sends no videos.
    processor = images_only(Qwen2VLProcessor)(image_processor=images, tokenizer=tok, chat_template=QWEN_CHAT_TEMPLATE)
    processor.save_pretrained(path)
    return path
