"""The one parser of sizes and the one parser of durations, shared by the CLI, the API and the settings,
so `2GiB` or `90m` means the same wherever a user types it."""

from __future__ import annotations

import re

from pydantic import ByteSize, TypeAdapter, ValidationError

_SIZE: TypeAdapter[ByteSize] = TypeAdapter(ByteSize)
_DURATION = re.compile(r"^\s*(\d{1,7}(?:\.\d+)?)\s*([smhd])\s*$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_size(text: str | int) -> int:
    """'2GiB', '512MB', '1.5 GB', '1000000' -> bytes (pydantic's ByteSize: decimal and binary units)."""
    try:
        return int(_SIZE.validate_python(text))
    except ValidationError:
        raise ValueError(f"{text!r} is not a size like 2GiB, 512MB or 1000000") from None


def parse_duration(text: str) -> float:
    """'24h', '90m', '1.5h', '30s', '7d' -> seconds (more than zero)."""
    m = _DURATION.match(text)
    seconds = float(m.group(1)) * _SECONDS[m.group(2)] if m else 0.0
    if seconds <= 0:
        raise ValueError(f"{text!r} is not a duration like 24h, 90m or 30s")
    return seconds
