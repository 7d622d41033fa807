"""Images in chat requests to vision-language models (LLaVA-style, ...): transformers' own processor and
vision encoder, the embeddings spliced into the decoder's input at the image tokens.

A chat request's prompt comes from the processor: its chat template, then the processor's expansion of
each image placeholder into the model's image tokens. Each image is an ``ImageItem``: its content hash,
the prompt positions its embedding rows go to, and (once encoded) those rows. The encoder runs once per
image content in a worker: the rows are cached by hash (n > 1 samples, repeated images and preempted
sequences pay once). The model runner asks ``step_images`` which rows of a step's packed tokens take
image rows, so chunked prefill may cut an image anywhere. Prefix caching keys each block by the hashes
of the images it overlaps (engine/block_manager.py), so equal placeholder tokens over different images
never share KV.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sluice.engine.config import EngineConfig
from sluice.engine.image_source import load_image
from sluice.engine.mrope import MRopePositions, prompt_positions, uses_mrope
from sluice.engine.outputs import Request

# Processor outputs that are the prompt's, not an image's encoder inputs.
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})


@dataclass(eq=False)
class ImageItem:
    key: str  # sha256 of the image's bytes: the encoder cache's and the prefix cache's key
    positions: np.ndarray  # ascending prompt positions that take this image's embedding rows, in order
    inputs: dict[str, torch.Tensor] | None = None  # the processor's tensors for this image alone (until encoded)
    embeds: torch.Tensor | None = None  # [len(positions), hidden] once encoded
    grid: tuple[int, int, int] | None = None  # its tokens' t/h/w grid, where the processor gives one (M-RoPE)

    def overlaps(self, start: int, end: int) -> bool:
        return bool(self.positions[0] < end and self.positions[-1] >= start)


def image_urls(messages: list[dict[str, Any]]) -> list[str]:
    """The image parts' URLs of chat messages (jobs/lines.py writes them as ``{"type": "image", "url": ...}``)."""
    return [p["url"] for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if isinstance(p, dict) and p.get("type") == "image"]


def is_vision_config(config: Any) -> bool:
    """A composite image-text-to-text model (a vision tower beside a text decoder)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return hasattr(config, "vision_config") and config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def contiguous_patch_embeddings(hf: torch.nn.Module) -> int:
    """Make the vision tower's patch embeddings come out contiguous; returns how many modules it hooked.

    SigLIP-style towers (Idefics3/SmolVLM, SigLIP) write ``conv(pixels).flatten(2).transpose(1, 2)``: a
    [tiles, patches, hidden] view with the hidden size as its slowest stride, which every residual add
    keeps, so each LayerNorm of every layer first copies its input. Made contiguous once, SmolVLM-256M's
    tower ran 0.94 s per 5-tile image instead of 1.16 (bfloat16, 2-core Xeon with AMX; its LayerNorms
    0.03 s instead of 0.11).
    """
    hooked = 0
    for module in hf.modules():
        if type(module).__name__.endswith("VisionEmbeddings"):
            module.register_forward_hook(lambda _m, _args, out: out.contiguous() if torch.is_tensor(out) else out)
            hooked += 1
    return hooked


class VisionEncoder:
    """A vision-language model's processor and image encoder, with the encoder's cache."""

    def __init__(self, hf: Any, processor: Any, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.hf = hf
        contiguous_patch_embeddings(hf)
        self.processor = processor
        self.config = config
        self.device = device
        self.dtype = dtype
        self.image_token = processor.image_token
        self.image_token_id = int(processor.tokenizer.convert_tokens_to_ids(self.image_token))
        self.mrope = uses_mrope(hf.config)  # Qwen2-VL-style: each prompt with images gets a t/h/w table
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_encoded = 0  # images run through the encoder
        self.num_cache_hits = 0  # images whose rows came from the cache

    # ---- the prompt -----------------------------------------------------------------------------
    def prompt(self, request: Request) -> tuple[list[int], list[ImageItem]]:
        """The prompt token ids of a chat request (image tokens expanded) and its images, in prompt order."""
        import jinja2

        assert request.messages is not None
        urls = image_urls(request.messages)
        if len(urls) > self.config.max_images_per_request:
            raise ValueError(f"{len(urls)} images in one request; at most {self.config.max_images_per_request}")
        loaded = [load_image(u, self.config) for u in urls]  # ValueError names the image
        try:
            text = self.processor.apply_chat_template(request.messages, tools=request.tools, add_generation_prompt=True,
                                                      tokenize=False, **dict(request.chat_template_kwargs or {}))
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template refused the request: {e}") from None
        images = [img for _, img in loaded]
        if not images:
            return list(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"]), []
        enc = self.processor(text=[text], images=images, add_special_tokens=False, return_tensors="pt")
        ids = [int(t) for t in enc["input_ids"][0]]
        # One image (the common line): the prompt's processor output is that image's. Several: each image
        # through the processor alone, to split the tensors per image (its image processing runs twice).
        items = ([self._item(loaded[0][0], enc)] if len(loaded) == 1 else
                 [self._item(data, self._process_alone(img)) for data, img in loaded])
        self._place(items, np.flatnonzero(np.asarray(ids) == self.image_token_id))
        return ids, items

    def _process_alone(self, image: Any) -> Any:
        """The processor's output for a lone placeholder and ``image``: its expansion is the same as inside
        the prompt."""
        return self.processor(text=[self.image_token], images=[image], add_special_tokens=False, return_tensors="pt")

    def _item(self, data: bytes, out: Any) -> ImageItem:
        """An image from the processor's output for a text whose only image it is: its encoder inputs, and how
        many image tokens it takes (all of that text's)."""
        key = hashlib.sha256(data).hexdigest()
        count = int((out["input_ids"][0] == self.image_token_id).sum())
        inputs = {k: v for k, v in out.items() if k not in _TEXT_KEYS}
        return ImageItem(key, np.empty(count, dtype=np.int64), inputs, grid=self._grid(out))

    def _grid(self, one: Any) -> tuple[int, int, int] | None:
        """The image's token grid: the processor's patch grid (``image_grid_thw``) merged ``merge_size`` x
        ``merge_size`` into tokens."""
        if "image_grid_thw" not in one:
            return None
        t, h, w = (int(x) for x in one["image_grid_thw"][0])
        merge = int(getattr(self.processor.image_processor, "merge_size", 1))
        return t, h // merge, w // merge

    def rope_positions(self, ids: list[int], items: list[ImageItem]) -> MRopePositions | None:
        """An M-RoPE model's position table of a prompt with images (None: plain positions serve)."""
        if not self.mrope or not items:
            return None
        runs = []
        for item in items:
            first, count = int(item.positions[0]), len(item.positions)
            if item.grid is None or int(item.positions[-1]) != first + count - 1:
                raise ValueError("an image's tokens are not one run with a grid, which M-RoPE positions need")
            runs.append((first, count, item.grid))
        return prompt_positions(len(ids), runs)

    @staticmethod
    def _place(items: list[ImageItem], where: np.ndarray) -> None:
        """Hand the prompt's image-token positions to the images in order, each its own count."""
        counts = [len(x.positions) for x in items]
        if sum(counts) != len(where):
            raise ValueError(f"the prompt has {len(where)} image tokens but its {len(items)} images take {sum(counts)} "
                             "(does the chat template write one image placeholder per image part?)")
        for item, chunk in zip(items, np.split(where, np.cumsum(counts)[:-1]), strict=True):
            item.positions = chunk

    # ---- the encoder ----------------------------------------------------------------------------
    def embeds(self, item: ImageItem) -> torch.Tensor:
        """The image's embedding rows: from the item, else the cache, else the encoder (then cached)."""
        if item.embeds is not None:
            return item.embeds
        rows = self.cache.get(item.key)
        if rows is not None and rows.shape[0] == len(item.positions):
            self.cache.move_to_end(item.key)
            self.num_cache_hits += 1
        else:
            rows = self._encode(item)
            self._remember(item.key, rows)
        item.embeds, item.inputs = rows, None
        return rows

    @torch.inference_mode()
    def _encode(self, item: ImageItem) -> torch.Tensor:
        assert item.inputs is not None
        inputs = {k: v.to(self.device, dtype=self.dtype if v.is_floating_point() else v.dtype)
                  for k, v in item.inputs.items()}
        out = self.hf.get_image_features(**inputs)
        feats = getattr(out, "pooler_output", out)
        if isinstance(feats, (list, tuple)):
            feats = torch.cat([f.reshape(-1, f.shape[-1]) for f in feats])
        rows = feats.reshape(-1, feats.shape[-1])
        if rows.shape[0] != len(item.positions):
            raise ValueError(f"the vision encoder gave {rows.shape[0]} rows for an image of {len(item.positions)} tokens")
        self.num_encoded += 1
        return rows

    def _remember(self, key: str, rows: torch.Tensor) -> None:
        self.cache[key] = rows
        while len(self.cache) > self.config.image_cache_size:
            self.cache.popitem(last=False)


@dataclass
class StepImages:
    """Rows of a step's packed tokens and the image embedding rows that replace their token embeddings."""

    rows: torch.Tensor  # [R] int64
    values: torch.Tensor  # [R, hidden]


def step_images(encoder: VisionEncoder, seqs: list[Any], num_new_tokens: list[int]) -> StepImages | None:
    """The image rows of a step, or None when no sequence computes an image token in it."""
    rows: list[np.ndarray] = []
    values: list[torch.Tensor] = []
    offset = 0
    for seq, n in zip(seqs, num_new_tokens, strict=True):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        for item in seq.images or ():
            if not item.overlaps(start, end):
                continue
            mask = (item.positions >= start) & (item.positions < end)
            rows.append(offset + item.positions[mask] - start)
            values.append(encoder.embeds(item)[torch.from_numpy(mask).to(encoder.device)])
        offset += n
    if not rows:
        return None
    return StepImages(torch.from_numpy(np.concatenate(rows)).to(encoder.device), torch.cat(values))


def needs_images(seqs: list[Any], num_new_tokens: list[int]) -> bool:
    """Whether any sequence computes an image token this step (such a step is never a padded decode graph's)."""
    return any(item.overlaps(s.num_computed_tokens, s.num_computed_tokens + n)
               for s, n in zip(seqs, num_new_tokens, strict=True) for item in (s.images or ()))
