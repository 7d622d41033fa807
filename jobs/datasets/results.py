"""Result columns: an OpenAI batch output line (what ``sluice generate`` and ``sluice results`` write)
-> the columns added to its source row: completion, finish_reason, usage, error (embeddings: the vector).
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

USAGE = pa.struct([("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()), ("total_tokens", pa.int64())])
ERROR = pa.struct([("code", pa.string()), ("message", pa.string())])
NO_RESULT = "no_result"  # a row the run ended without (cancelled, interrupted): resume runs it again


def result_fields(embeddings: bool = False) -> list[tuple[str, pa.DataType]]:
    """The added columns, by their base names, and their Arrow types."""
    if embeddings:
        return [("embedding", pa.list_(pa.float32())), ("usage", USAGE), ("error", ERROR)]
    return [("completion", pa.string()), ("finish_reason", pa.string()), ("usage", USAGE), ("error", ERROR)]


def result_columns(line: dict[str, Any], embeddings: bool = False) -> dict[str, Any]:
    """The result columns of one output line; a failed request has only ``error`` (code, message)."""
    out: dict[str, Any] = dict.fromkeys(name for name, _ in result_fields(embeddings))
    response = line.get("response") or {}
    body = response.get("body") if isinstance(response, dict) else None
    body = body if isinstance(body, dict) else {}
    error = line.get("error") or body.get("error")
    if error is not None or response.get("status_code", 200) != 200:
        err = error if isinstance(error, dict) else {"message": str(error)}
        out["error"] = {"code": str(err.get("code") or "error"), "message": str(err.get("message") or "")}
        return out
    if isinstance(body.get("usage"), dict):
        u = body["usage"]
        prompt, completion = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
        out["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                        "total_tokens": int(u.get("total_tokens") or prompt + completion)}
    if embeddings:
        data = body.get("data") or [{}]
        out["embedding"] = data[0].get("embedding")
        return out
    choice = (body.get("choices") or [{}])[0]
    message = choice.get("message")
    out["completion"] = message.get("content") if isinstance(message, dict) else choice.get("text")
    out["finish_reason"] = choice.get("finish_reason")
    return out


def error_columns(code: str, message: str, embeddings: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = dict.fromkeys(name for name, _ in result_fields(embeddings))
    out["error"] = {"code": code, "message": message}
    return out


def columns_from_output_row(row: dict[str, Any], prefix: str, embeddings: bool) -> dict[str, Any]:
    """The result columns of a row of an earlier output (CSV keeps usage and error as JSON text)."""
    out: dict[str, Any] = {}
    for name, _ in result_fields(embeddings):
        v = row.get(prefix + name)
        if isinstance(v, str) and name in ("usage", "error", "embedding"):
            v = json.loads(v) if v else None
        out[name] = v if v != "" else None
    return out
