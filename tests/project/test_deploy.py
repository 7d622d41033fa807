"""docker-compose.yml and the Dockerfiles, checked without a Docker engine: the Compose schema, the
durability and GPU settings the stack depends on, and the commands the containers run parse as
`sluice` commands."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from sluice.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
# Beside the project on our machines; a user's clone has no ../shared, so the schema test skips there.
SCHEMA = ROOT.parent / "shared" / "data" / "compose" / "compose-spec.json"
# The bundled server unless SLUICE_REDIS_URL names another (an external cluster: redis+cluster://...).
REDIS_URL = "${SLUICE_REDIS_URL:-redis://redis:6379/0}"


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


def test_cluster_profile_starts_three_durable_primaries(compose: dict[str, Any]) -> None:
    services = compose["services"]
    nodes = {name: s for name, s in services.items() if name.startswith("valkey-") and name[-1].isdigit()}
    assert len(nodes) == 3
    for name, node in nodes.items():
        assert node["profiles"] == ["cluster"] and node["hostname"] == name
        opts = dict(zip(*[iter(shlex.split(node["command"])[1:])] * 2, strict=True))
        assert opts["--cluster-enabled"] == "yes" and opts["--appendonly"] == "yes"
        assert opts["--maxmemory-policy"] == "noeviction"
        assert node["volumes"] == [f"{name}-data:/data"] and f"{name}-data" in compose["volumes"]
    init = services["valkey-cluster-init"]
    assert init["profiles"] == ["cluster"]
    assert {n: c["condition"] for n, c in init["depends_on"].items()} == {n: "service_healthy" for n in nodes}
    script = init["command"][0]
    assert "--cluster create" in script and all(n in script for n in nodes)
    # The workers and the API wait for it when the profile is on, and do without it otherwise.
    for name in [*workers(compose), "api"]:
        dep = services[name]["depends_on"]["valkey-cluster-init"]
        assert dep == {"condition": "service_completed_successfully", "required": False}, name


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
        assert w["environment"]["SLUICE_REDIS_URL"] == REDIS_URL
        assert any(v.startswith("model-cache:") for v in w["volumes"])
        assert w["build"]["dockerfile"] == "docker/Dockerfile.worker"
        # The drain after SIGTERM (--grace-period) must fit before compose's SIGKILL.
        grace = cli.commands["worker"].make_context("worker", w["command"][2:]).params["grace_period"]
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
    assert env["SLUICE_REDIS_URL"] == REDIS_URL
    assert f"api-files:{env['SLUICE_FILES_DIR']}" in api["volumes"] and "api-files" in compose["volumes"]
    assert "/healthz" in " ".join(api["healthcheck"]["test"])
    ctx = cli.commands["serve"].make_context("serve", api["command"][2:])  # the flags exist and parse
    assert ctx.params["host"] == "0.0.0.0"


@pytest.mark.parametrize("kv", ["", "60GiB"])
def test_worker_command_reads_the_variables(compose: dict[str, Any], kv: str) -> None:
    """No shell builds flags: `sluice worker` reads SLUICE_MODEL and SLUICE_KV_CACHE_MEMORY itself."""
    command = compose["services"]["worker-gpu0"]["command"]
    assert command[:2] == ["sluice", "worker"]
    env = {"SLUICE_MODEL": "org/Some Model", "SLUICE_KV_CACHE_MEMORY": kv}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        ctx = cli.commands["worker"].make_context("worker", command[2:])
    assert ctx.params["model"] == "org/Some Model"  # a value with a space stays one value
    assert ctx.params["kv_cache_memory"] == (60 * 2**30 if kv else None)  # empty -> the engine's own default
    assert ctx.params["metrics_port"] == 9100


def test_workers_are_healthchecked_and_every_service_has_an_init(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        assert service.get("init") is True, f"{name}: an init reaps children and forwards signals"
    for name, w in workers(compose).items():
        port = cli.commands["worker"].make_context("worker", w["command"][2:]).params["metrics_port"]
        test = " ".join(w["healthcheck"]["test"])
        assert f"http://127.0.0.1:{port}/metrics" in test, f"{name}: the healthcheck asks the metrics port"
        assert w["healthcheck"]["start_period"].endswith("m"), f"{name}: loading a model takes minutes"


def test_compose_variables_have_the_documented_defaults(compose: dict[str, Any]) -> None:
    env = compose["services"]["worker-gpu0"]["environment"]
    assert env["SLUICE_MODEL"] == "${SLUICE_MODEL:-SmolLM2-135M-Instruct}"
    assert env["SLUICE_KV_CACHE_MEMORY"] == "${SLUICE_KV_CACHE_MEMORY:-}"
    from sluice.engine.loader import DEFAULT_MODEL

    assert DEFAULT_MODEL == "SmolLM2-135M-Instruct"


def test_images_install_dependencies_before_the_code() -> None:
    """A code change must not reinstall the dependencies: they are installed from pyproject.toml alone,
    in a layer before `COPY . .`."""
    for name, extras in (("Dockerfile.api", '""'), ("Dockerfile.worker", "worker,triton")):
        lines = (ROOT / "docker" / name).read_text().splitlines()
        copy_all = lines.index("COPY . .")
        before = "\n".join(lines[:copy_all])
        assert re.search(r"^COPY pyproject.toml ", before, re.M) and "COPY scripts/install.sh" in before
        assert f"scripts/install.sh --deps-only /opt/venv/bin/python {extras}" in before, name
        assert not re.search(r"^COPY (?!pyproject.toml|scripts/install.sh)", before, re.M), name


def test_api_dependencies_and_imports_have_no_model_code() -> None:
    """The API (and the job plane, and the CLI's queue commands) run where torch, transformers and
    triton are not installed: they are not among the package's own dependencies, and importing and
    serving the API with them made unimportable works."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    heavy = ("torch", "transformers", "triton", "gguf", "accelerate")
    assert not [d for d in project["dependencies"] if d.startswith(heavy)], project["dependencies"]
    assert {"torch", "transformers"} <= {re.split(r"[<>=\[ ]", d)[0] for d in project["optional-dependencies"]["worker"]}
    code = f"""
import sys
from importlib.abc import MetaPathFinder

class NotInstalled(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        # the model code: every sluice.engine module but the plain options one, sluice.kernels, sluice.worker
        model_code = name.startswith(("sluice.kernels", "sluice.worker", "sluice.engine.")) and name != "sluice.engine.config"
        if name.split(".")[0] in {heavy!r} or model_code:
            raise ImportError(f"{{name}} is not installed here")

sys.meta_path.insert(0, NotInstalled())
from fastapi.testclient import TestClient
from click.testing import CliRunner
from sluice.api.app import create_app
from sluice.api.settings import Settings
from sluice.cli.main import cli
import sluice.jobs.celery_app

c = TestClient(create_app(Settings(redis_url="redis://127.0.0.1:1/0")))
assert c.get("/openapi.json").status_code == 200 and c.get("/healthz").status_code == 503
assert "sluice_job_server_up 0.0" in c.get("/metrics").text
for args in (["serve", "--help"], ["submit", "--help"], ["server", "--help"], ["--version"]):
    assert CliRunner().invoke(cli, args).exit_code == 0, args
for args in (["worker"], ["up"], ["generate", "-", "-o", "-"]):  # the engine's commands say what is missing
    res = CliRunner().invoke(cli, args, input="")
    assert res.exit_code == 1 and "pip install 'sluice-llm[worker]'" in res.stderr, (args, res.output)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


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
