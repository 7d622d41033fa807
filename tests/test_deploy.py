"""docker-compose.yml and the Dockerfiles, checked without a Docker engine: the Compose schema, the
durability and GPU settings the stack depends on, and the commands the containers run parse as
`sluice` commands."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from cli.main import cli

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
# Beside the project on our machines; a user's clone has no ../shared, so the schema test skips there.
SCHEMA = ROOT.parent / "shared" / "data" / "compose" / "compose-spec.json"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())  # safe_load resolves the `<<: *worker` merge keys


def workers(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose["services"].items() if name.startswith("worker")}


def test_compose_file_matches_the_compose_schema(compose: dict[str, Any]) -> None:
    if not SCHEMA.exists():
        pytest.skip(f"no Compose schema at {SCHEMA} (it sits beside the project on the dev machines only)")
    import jsonschema

    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)  # the file says draft-07 (under a URL jsonschema does not know)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_redis_is_durable_and_healthchecked(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    args = shlex.split(redis["command"]) if isinstance(redis["command"], str) else redis["command"]
    opts = dict(zip(args[1::2], args[2::2], strict=False))  # valkey-server --name value ...
    assert opts["--appendonly"] == "yes" and opts["--appendfsync"] == "everysec"
    assert opts["--maxmemory-policy"] == "noeviction"  # an evicted job would be lost silently
    # Bounded, so "full" is an error the submitter sees, not the host running out of memory.
    assert re.fullmatch(r"\$\{SLUICE_REDIS_MAXMEMORY:-\d+[kmg]b\}", opts["--maxmemory"])
    assert "ping" in redis["healthcheck"]["test"]
    assert f"redis-data:{opts['--dir']}" in redis["volumes"]
    assert "redis-data" in compose["volumes"]


def test_one_worker_service_per_gpu(compose: dict[str, Any]) -> None:
    ws = workers(compose)
    assert len(ws) >= 2, "show how a second GPU gets its own service"
    seen: list[str] = []
    for name, w in ws.items():
        (device,) = w["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
        assert "count" not in device, f"{name}: device_ids pins one GPU; count would not"
        seen += device["device_ids"]
        assert w["depends_on"]["redis"]["condition"] == "service_healthy"
        assert w["environment"]["SLUICE_REDIS_URL"].startswith("redis://redis:")
        assert any(v.startswith("model-cache:") for v in w["volumes"])
        assert w["build"]["dockerfile"] == "docker/Dockerfile.worker"
        # The drain after SIGTERM (--grace-period) must fit before compose's SIGKILL.
        grace = float(re.search(r"--grace-period (\d+)", w["command"][-1])[1])  # type: ignore[index]
        assert float(w["stop_grace_period"].rstrip("s")) > grace
    assert len(seen) == len(set(seen)), f"two worker services share a GPU: {seen}"
    assert "model-cache" in compose["volumes"]
    assert "profiles" not in ws["worker-gpu0"], "the first worker runs with a plain `docker compose up`"


def test_api_service(compose: dict[str, Any]) -> None:
    api = compose["services"]["api"]
    assert api["command"][:2] == ["sluice", "serve"] and api["build"]["dockerfile"] == "docker/Dockerfile.api"
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"
    env = api["environment"]
    assert env["SLUICE_API_KEY"].startswith("${SLUICE_API_KEY:?"), "an exposed API must not start without a key"
    assert env["SLUICE_REDIS_URL"].startswith("redis://redis:")
    assert f"api-files:{env['SLUICE_FILES_DIR']}" in api["volumes"] and "api-files" in compose["volumes"]
    assert "/healthz" in " ".join(api["healthcheck"]["test"])
    ctx = cli.commands["serve"].make_context("serve", api["command"][2:])  # the flags exist and parse
    assert ctx.params["host"] == "0.0.0.0"


def _worker_argv(command: list[str], tmp_path: Path, **env: str) -> list[str]:
    """What the worker container would exec: its `sh -c` command run against a stub `sluice`."""
    stub = tmp_path / "sluice"
    stub.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    stub.chmod(0o755)
    script = command[-1].replace("$$", "$")  # compose's escape for a literal $
    out = subprocess.run([*command[:-1], script], env={"PATH": f"{tmp_path}:{os.environ['PATH']}", **env},
                         capture_output=True, text=True, check=True).stdout
    return out.splitlines()


@pytest.mark.parametrize("kv", ["", "60GiB"])
def test_worker_command_passes_the_variables_as_flags(compose: dict[str, Any], tmp_path: Path, kv: str) -> None:
    command = compose["services"]["worker-gpu0"]["command"]
    assert command[:2] == ["sh", "-c"]
    argv = _worker_argv(command, tmp_path, SLUICE_MODEL="org/Some Model", SLUICE_KV_CACHE_MEMORY=kv)
    assert argv[0] == "worker"
    ctx = cli.commands["worker"].make_context("worker", argv[1:])
    assert ctx.params["model"] == "org/Some Model"  # quoted: a value with a space stays one argument
    assert ctx.params["kv_cache_memory"] == (kv or None)  # unset -> the engine's own default


def test_compose_variables_have_the_documented_defaults(compose: dict[str, Any]) -> None:
    env = compose["services"]["worker-gpu0"]["environment"]
    assert env["SLUICE_MODEL"] == "${SLUICE_MODEL:-SmolLM2-135M-Instruct}"
    assert env["SLUICE_KV_CACHE_MEMORY"] == "${SLUICE_KV_CACHE_MEMORY:-}"
    from engine.loader import DEFAULT_MODEL

    assert DEFAULT_MODEL == "SmolLM2-135M-Instruct"


def test_images_and_make_share_one_install_recipe() -> None:
    worker = (ROOT / "docker" / "Dockerfile.worker").read_text()
    api = (ROOT / "docker" / "Dockerfile.api").read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+$", worker, re.M) and "FROM ${CUDA_IMAGE}" in worker
    assert re.search(r"^FROM python:3\.\d+-slim$", api, re.M)
    for text in (worker, api, (ROOT / "Makefile").read_text()):
        assert "scripts/install.sh" in text
        # No second recipe: the only pip install in an image is inside scripts/install.sh.
        assert "pip install" not in text
    assert os.access(ROOT / "scripts" / "install.sh", os.X_OK)


def test_image_commands_are_sluice_commands() -> None:
    for name in ("Dockerfile.worker", "Dockerfile.api"):
        cmd = json.loads(re.search(r"^CMD (.+)$", (ROOT / "docker" / name).read_text(), re.M)[1])  # type: ignore[index]
        assert cmd[0] == "sluice"
        command = cli.commands[cmd[1]]
        assert isinstance(command, click.Command)
        command.make_context(cmd[1], cmd[2:])
