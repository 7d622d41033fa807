"""The API's settings: the job plane's (``jobs.settings``) plus its own limits, read from the environment
when the app is built (``SLUICE_MAX_UPLOAD_BYTES``, ...; the README's configuration table lists them)."""

from __future__ import annotations

from typing import Any

from pydantic import field_validator

from jobs.settings import JobPlaneSettings
from jobs.units import parse_size


class Settings(JobPlaneSettings):
    api_key: str | None = None
    """SLUICE_API_KEY: the bearer token every /v1 request needs (none: no check)."""
    max_upload_bytes: int = 200 * 10**6
    """SLUICE_MAX_UPLOAD_BYTES: the largest upload (a size: 200000000, 200MB, 1GiB)."""
    max_batch_lines: int = 50_000
    # Characters, not tokens: the API never loads a tokenizer. 256k chars is roughly 64k tokens.
    max_prompt_chars: int = 256 * 1024

    @field_validator("max_upload_bytes", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int:
        return parse_size(v)

    @field_validator("max_upload_bytes", "max_batch_lines", "max_prompt_chars")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError("must be at least 1")
        return v
