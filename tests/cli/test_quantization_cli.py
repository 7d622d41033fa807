"""``--quantization`` from the command line to the engine, and the quantization a worker loaded in
``/v1/models`` (from its heartbeat)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import redis
from click.testing import CliRunner
from fastapi.testclient import TestClient
from sluice.api.app import create_app
from sluice.api.settings import Settings
from sluice.cli.main import cli
from sluice.jobs.consumer.commands import beat

pytest_plugins = ["jobs_fixtures"]


def test_generate_runs_int8_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    """--quantization int8 and --memory-budget reach the engine (the KV cache is what the weights leave)."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"c{i}", "prompt": f"Tell me {i}", "max_tokens": 4}) + "\n"
                           for i in range(3)))
    args = ["generate", str(src), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32",
            "--memory-budget", "64MiB", "--quantization", "int8", "--no-progress"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and all(r["error"] is None for r in rows)


def test_int4_on_cpu_is_a_one_line_user_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "x"}\n')
    p = subprocess.run([sys.executable, "-m", "sluice.cli.main", "generate", str(src), "-o", str(tmp_path / "o.jsonl"),
                        "--model", str(tiny_model_dir), "--quantization", "int4"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr and "int4 needs CUDA" in p.stderr


def test_models_say_the_quantization_each_queue_runs(r: redis.Redis, tmp_path: Path) -> None:
    # Heartbeats as workers write them (jobs/schemas.WorkerHeartbeat); w3's is from before the field.
    beat(r, "w1", json.dumps({"id": "w1", "queue": "big", "serves": "generation", "quantization": "int8"}), 60_000)
    beat(r, "w2", json.dumps({"id": "w2", "queue": "big", "serves": "generation", "quantization": "none"}), 60_000)
    beat(r, "w3", json.dumps({"id": "w3", "queue": "old", "serves": "generation"}), 60_000)
    app = create_app(Settings(api_key=None, files_dir=tmp_path / "files"))
    models = TestClient(app).get("/v1/models").json()["data"]
    assert {m["id"]: m["quantization"] for m in models} == {"big": ["int8", "none"], "old": ["none"]}
