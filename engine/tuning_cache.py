"""Choices measured at start-up (the GEMM path, ``--dtype auto``) kept across runs, so that a second
``sluice generate`` on the same machine does not time the same matmuls again.

An entry is keyed by everything its measurement depended on: the CPU (model name and feature flags),
torch's version and build, the project's kernel sources where they were timed, and the caller's own
parts (dtype, shapes, settings). The full key is stored beside the value and compared on read, so a
hash collision or an entry written by another version is a miss. A file that cannot be read or parsed,
or a value the caller finds stale, is ignored and measured again; a cache that cannot be written (a
read-only home) costs only the measurement. Set SLUICE_TUNING_CACHE=off to always measure.

Where: SLUICE_HOME/cache/tuning when SLUICE_HOME is set, else the per-user cache directory
(platformdirs), e.g. ~/.cache/sluice/tuning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import platformdirs
import torch

log = logging.getLogger(__name__)

ENV_HOME = "SLUICE_HOME"  # the same variable the job plane reads (jobs/server.py); read here, not imported
ENV_SWITCH = "SLUICE_TUNING_CACHE"
VERSION = 1  # bump when an entry's meaning changes


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "on").strip().lower() not in ("off", "0", "false", "no")


def directory() -> Path:
    home = os.environ.get(ENV_HOME)
    base = Path(home) / "cache" if home else Path(platformdirs.user_cache_dir("sluice", appauthor=False))
    return base / "tuning"


def machine() -> dict[str, Any]:
    """What any measurement here depends on: the CPU and the torch build."""
    cpu, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model") and not cpu:
                cpu = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    cpu = cpu or platform.processor()
    return {"cpu": cpu, "flags": flags, "machine": platform.machine(), "cores": len(os.sched_getaffinity(0)),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "torch_config": torch.__config__.show()}


def full_key(kind: str, parts: dict[str, Any]) -> dict[str, Any]:
    return {"version": VERSION, "kind": kind, "machine": machine(), "parts": parts}


def _path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return directory() / f"{key['kind']}-{digest}.json"


def get(kind: str, parts: dict[str, Any]) -> tuple[Any, Path] | None:
    """The value stored for this key and its file, or None (no entry, an unreadable one, or caching off)."""
    if not enabled():
        return None
    key = json.loads(json.dumps(full_key(kind, parts), sort_keys=True, default=str))
    path = _path(key)
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring the unreadable tuning cache entry %s: %s", path, e)
        return None
    if not isinstance(entry, dict) or entry.get("key") != key or "value" not in entry:
        log.warning("ignoring the tuning cache entry %s: it was written for another key", path)
        return None
    return entry["value"], path


def put(kind: str, parts: dict[str, Any], value: Any) -> None:
    """Store ``value`` (JSON) for this key, atomically: a reader sees the old file or the new, never half."""
    if not enabled():
        return
    key = json.loads(json.dumps(full_key(kind, parts), sort_keys=True, default=str))
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            json.dump({"key": key, "value": value}, f)
        os.replace(f.name, path)
    except OSError as e:
        log.info("not caching the %s choice in %s: %s", kind, path.parent, e)
