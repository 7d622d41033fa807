"""The API's settings, read from the environment when the app is built."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from jobs.server import sluice_home


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw else default


@dataclass(frozen=True)
class Settings:
    api_key: str | None = field(default_factory=lambda: os.environ.get("SLUICE_API_KEY") or None)
    max_upload_bytes: int = field(default_factory=lambda: _env_int("SLUICE_MAX_UPLOAD_BYTES", 200 * 10**6))
    max_batch_lines: int = field(default_factory=lambda: _env_int("SLUICE_MAX_BATCH_LINES", 50_000))
    # Characters, not tokens: the API never loads a tokenizer. 256k chars is roughly 64k tokens.
    max_prompt_chars: int = field(default_factory=lambda: _env_int("SLUICE_MAX_PROMPT_CHARS", 256 * 1024))
    files_dir: Path = field(default_factory=lambda: Path(os.environ.get("SLUICE_FILES_DIR") or sluice_home() / "files"))
    redis_url: str | None = None  # default: SLUICE_REDIS_URL, else the embedded server of SLUICE_HOME
