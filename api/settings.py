"""The API's settings: the job plane's (``sluice.jobs.settings``) plus its own limits, read from the environment
when the app is built (``SLUICE_MAX_UPLOAD_BYTES``, ...; docs/configuration.md's table lists them)."""

from __future__ import annotations

from typing import Any

from pydantic import field_validator
from sluice.jobs.schemas import MAX_PRIORITY
from sluice.jobs.settings import JobPlaneSettings
from sluice.jobs.units import parse_size


class Settings(JobPlaneSettings):
    api_key: str | None = None
    """SLUICE_API_KEY: the bearer token every /v1 request needs (none: no check)."""
    max_upload_bytes: int = 200 * 10**6
    """SLUICE_MAX_UPLOAD_BYTES: the largest upload (a size: 200000000, 200MB, 1GiB)."""
    max_batch_lines: int = 50_000
    # Characters, not tokens: the API never loads a tokenizer. 256k chars is roughly 64k tokens.
    max_prompt_chars: int = 256 * 1024
    interactive_priority: int = 100
    """SLUICE_INTERACTIVE_PRIORITY: the queue priority of /v1/chat/completions and /v1/completions requests
    (batches default to 0: higher is pulled first)."""
    interactive_timeout: float = 600.0
    """SLUICE_INTERACTIVE_TIMEOUT: seconds such a request waits for its answer; then 504, its job cancelled."""
    interactive_max_waiting: int = 4096
    """SLUICE_INTERACTIVE_MAX_WAITING: such requests waiting per model at most (over all API replicas); past it, 429."""
    webhook_url: str | None = None
    """SLUICE_WEBHOOK_URL: where batch events (batch.completed, ...) are POSTed for batches that name no URL of
    their own (none: only batches that name one get them)."""
    webhook_secret: str | None = None
    """SLUICE_WEBHOOK_SECRET: the key that signs them (Standard Webhooks' ``whsec_<base64>``, or any string)."""
    webhook_allowed_urls: str = ""
    """SLUICE_WEBHOOK_ALLOWED_URLS: comma-separated URL prefixes a batch may name as its webhook (metadata
    ``sluice_webhook_url``); empty: none (SLUICE_WEBHOOK_URL is always allowed)."""
    webhook_retry_after: float = 5.0
    """SLUICE_WEBHOOK_RETRY_AFTER: seconds before a failed delivery is retried, doubling each time (at most an hour)."""
    webhook_max_attempts: int = 15
    """SLUICE_WEBHOOK_MAX_ATTEMPTS: deliveries of one event tried at most (then recorded as failed)."""

    @field_validator("max_upload_bytes", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int:
        return parse_size(v)

    @field_validator("interactive_priority")
    @classmethod
    def _priority(cls, v: int) -> int:
        if not -MAX_PRIORITY <= v <= MAX_PRIORITY:
            raise ValueError(f"must be between {-MAX_PRIORITY} and {MAX_PRIORITY}")
        return v

    @field_validator("webhook_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return v

    @field_validator("interactive_timeout", "webhook_retry_after")
    @classmethod
    def _seconds(cls, v: float) -> float:
        if not v > 0:
            raise ValueError("must be more than 0 seconds")
        return v

    @field_validator("max_upload_bytes", "max_batch_lines", "max_prompt_chars", "interactive_max_waiting",
                     "webhook_max_attempts")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError("must be at least 1")
        return v
