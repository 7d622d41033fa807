"""A vision-language model's processor, loadable without torchvision.

transformers' processors for models that also take videos (Qwen2-VL, Qwen2.5-VL) load a video processor
that needs torchvision, so ``AutoProcessor`` fails without it even though Sluice never sends videos (and so does a checkpoint saved without one). The
fallback is the same processor class with its video sub-processor left out: the image processor
(transformers' PIL backend), the tokenizer and the chat template are the checkpoint's own.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_VIDEO = "video_processor"


def load_processor(path: str) -> Any:
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path)
    except (ImportError, OSError):  # no torchvision for the video processor, or no video processor saved
        cls = _processor_class(path)
        if cls is None or _VIDEO not in cls.get_attributes():
            raise
        log.info("%s: no torchvision, so no video processor; images and text only", cls.__name__)
        return images_only(cls).from_pretrained(path)


def _processor_class(path: str) -> Any:
    from transformers.models.auto.processing_auto import processor_class_from_name

    saved = Path(path) / "processor_config.json"
    name = json.loads(saved.read_text()).get("processor_class") if saved.is_file() else None
    return processor_class_from_name(name) if name else None


@functools.cache
def images_only(cls: Any) -> Any:
    """``cls`` (a ``ProcessorMixin`` with a ``video_processor``) without it: transformers lists a processor's
    sub-processors from its ``__init__`` signature, so a signature without ``video_processor`` drops it."""

    def __init__(self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                 **kwargs: Any) -> None:
        cls.__init__(self, image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template,
                     **{_VIDEO: None}, **kwargs)

    # The same name: save_pretrained writes it as the processor_class, which AutoProcessor reads back.
    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__})
