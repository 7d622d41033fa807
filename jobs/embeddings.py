"""The ``/v1/embeddings`` wire format, in pure Python (no torch): a batch line's body checked, and the
vectors an engine made rendered as OpenAI's ``CreateEmbeddingResponse``.

``encoding_format`` "float" gives each vector as JSON numbers, rounded to the 9 significant digits that
spell a float32 exactly (the vectors are float32; more digits would only be noise); "base64" gives the
float32 values' little-endian bytes in base64, as OpenAI's API and client read them.
"""

from __future__ import annotations

import base64
import math
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

EMBEDDINGS_URL = "/v1/embeddings"
ENCODING_FORMATS = ("float", "base64")
BODY_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})
MAX_INPUTS = 2048  # inputs per request, OpenAI's limit: each is a vector in the one result the job writes

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


@dataclass(frozen=True)
class EmbeddingBody:
    input: EmbeddingInput
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


def parse_embedding_body(body: Any) -> EmbeddingBody:
    """A ``/v1/embeddings`` request body, checked; a ValueError says what is wrong with it."""
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    unknown = sorted(set(body) - BODY_FIELDS)
    if unknown:
        raise ValueError(f"unsupported field(s) for /v1/embeddings: {', '.join(unknown)}")
    if "input" not in body:
        raise ValueError("body.input is required")
    inp = check_input(body["input"])
    fmt = body.get("encoding_format") or "float"
    if fmt not in ENCODING_FORMATS:
        raise ValueError(f"encoding_format must be one of {ENCODING_FORMATS}, not {fmt!r}")
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise ValueError(f"dimensions must be a positive integer, not {dims!r}")
    model, user = body.get("model"), body.get("user")
    for name, value in (("model", model), ("user", user)):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{name} must be a string")
    return EmbeddingBody(inp, model, fmt, dims, user)


def check_input(inp: Any) -> EmbeddingInput:
    """A string, a non-empty list of strings, of token ids, or of non-empty token id lists; at most
    MAX_INPUTS strings or token id lists (a list of token ids is one input)."""
    shapes = "a string, a list of strings, a list of token ids, or a list of token id lists"
    if isinstance(inp, str):
        if not inp:
            raise ValueError("input is an empty string")
        return inp
    if not isinstance(inp, list) or not inp:
        raise ValueError(f"input must be {shapes} (not empty)")
    if len(inp) > MAX_INPUTS and not _is_token(inp[0]):
        raise ValueError(f"input has {len(inp)} items; at most {MAX_INPUTS} per request (split it into several)")
    if all(isinstance(x, str) for x in inp):
        empty = [i for i, x in enumerate(inp) if not x]
        if empty:
            raise ValueError(f"input[{empty[0]}] is an empty string")
        return inp
    if all(_is_token(x) for x in inp):
        return inp
    if all(isinstance(x, list) and x and all(_is_token(y) for y in x) for x in inp):
        return inp
    raise ValueError(f"input must be {shapes}; token ids are non-negative integers")


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


# ---- rendering --------------------------------------------------------------------------------
def float32_list(vector: Sequence[float]) -> list[float]:
    """Each value as the shortest decimal that reads back as the same float32 (9 digits always do)."""
    return [float(f"{x:.9g}") for x in vector]


def encode_base64(vector: Sequence[float]) -> str:
    """Little-endian float32 bytes, base64 (what ``encoding_format="base64"`` returns)."""
    arr = array("f", vector)
    if sys.byteorder != "little":
        arr.byteswap()
    return base64.b64encode(arr.tobytes()).decode("ascii")


def decode_base64(text: str) -> list[float]:
    raw = base64.b64decode(text)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def embedding_response(vectors: Sequence[Sequence[float]], model: str, prompt_tokens: int,
                       encoding_format: str = "float") -> dict[str, Any]:
    """OpenAI's ``CreateEmbeddingResponse``: one ``data`` entry per input, in input order."""
    if encoding_format not in ENCODING_FORMATS:
        raise ValueError(f"encoding_format must be one of {ENCODING_FORMATS}, not {encoding_format!r}")
    render = encode_base64 if encoding_format == "base64" else float32_list
    for i, v in enumerate(vectors):
        if not all(math.isfinite(x) for x in v):
            raise ValueError(f"vector {i} is not finite")
    data = [{"object": "embedding", "index": i, "embedding": render(v)} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
