"""A chat request's prompt: its messages through the tokenizer's chat template, with the request's
template options (``chat_template_kwargs``: ``enable_thinking``, ``reasoning_effort``, ...; unknown keys
are the template's business, as in transformers and vLLM)."""

from __future__ import annotations

import functools
import inspect
from typing import Any

from sluice.engine.outputs import Request


def render_chat(tokenizer: Any, request: Request) -> list[int]:
    """The prompt token ids of ``request.messages``; ValueError when the template refuses them."""
    import jinja2

    extra = dict(request.chat_template_kwargs or {})
    taken = sorted(set(extra) & _own_arguments(type(tokenizer)))  # type: ignore[arg-type]  # a class is hashable
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {taken[0]!r} (an argument of apply_chat_template itself)")
    try:
        ids = tokenizer.apply_chat_template(request.messages, tools=request.tools, add_generation_prompt=True,
                                            tokenize=True, return_dict=False, **extra)
    except jinja2.TemplateError as e:  # the template's own raise_exception, or a key it cannot take
        raise ValueError(f"the chat template refused the request: {e}") from None
    return list(ids)


@functools.cache
def _own_arguments(tokenizer_type: Any) -> frozenset[str]:
    params = inspect.signature(tokenizer_type.apply_chat_template).parameters
    return frozenset(k for k, p in params.items() if p.kind is not p.VAR_KEYWORD and k != "self")
