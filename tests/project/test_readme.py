"""The README and the docs (docs/*.md, ARCHITECTURE.md) cannot drift from the code: every command, flag,
environment variable, make target, compose service and path they name exists; the configuration tables
(docs/configuration.md) list every flag and variable with the defaults the code has; and the OpenAI SDK
example runs against a live API. tests/project/test_docs.py builds the site and runs the shell examples."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner
from docs_helpers import SHELL, all_text, text
from sluice.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
# Every page a reader sees, one after another: a flag, a path or a table may live in any of them.
README = all_text()
PACKAGES = ["cli", "api", "jobs", "worker", "engine", "kernels"]
ENV_NAME = r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+"
# Variables the README documents that other software reads, and which one.
THIRD_PARTY_ENV = {
    "HF_HOME": "huggingface_hub (transformers' hub cache)",
    "GOMP_SPINCOUNT": "libgomp (torch's OpenMP), set by engine/omp_spin.py for embedding models",
    "OMP_WAIT_POLICY": "libgomp (torch's OpenMP): a user's setting wins over engine/omp_spin.py's",
    "OTEL_TRACES_EXPORTER": "OpenTelemetry (jobs/tracing.py reads it too: set, tracing is on)",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "OpenTelemetry's OTLP exporter",
    "OTEL_SERVICE_NAME": "OpenTelemetry's SDK (the trace's service name)",
    "FSSPEC_S3_ENDPOINT_URL": "fsspec's configuration from the environment (s3fs's endpoint_url)",
    "OTEL_TRACES_SAMPLER": "OpenTelemetry's SDK",
}


# ---- reading the README ----------------------------------------------------------------------------
def code_blocks() -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", README, re.M | re.S)


def section(title: str) -> str:
    m = re.search(rf"^(#+) {re.escape(title)}\n(.*?)(?=^#{{1,2}} |\Z)", README, re.M | re.S)
    assert m, f"no section {title!r} in the README"
    return m.group(2)


def tables(text: str = README) -> list[list[dict[str, str]]]:
    """Markdown tables as lists of {header: cell}."""
    found = []
    for block in re.findall(r"((?:^\|.*\|\n)+)", text, re.M):
        rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in block.strip().splitlines()]
        found.append([dict(zip(rows[0], r, strict=True)) for r in rows[2:]])
    return found


def table_with(header: str, first_cell: str) -> list[dict[str, str]]:
    """The table whose first column is ``header`` and that has a row starting with ``first_cell``."""
    for t in tables():
        if t and header in t[0] and any(first_cell in r[header] for r in t):
            return t
    raise AssertionError(f"no table with a {header!r} column holding {first_cell!r}")


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def command_lines() -> Iterator[list[str]]:
    """Shell command lines of the shell code blocks, as words, comments dropped, split at &&."""
    for lang, body in code_blocks():
        if lang not in SHELL:
            continue
        for line in body.splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue  # the ASCII picture and the folder map are not commands
            while words:
                cut = next((i for i, w in enumerate(words) if w in ("&&", "|")), len(words))
                yield words[:cut]
                words = words[cut + 1:]


def commands_of(program: str) -> list[list[str]]:
    """The README's command lines running ``program``, from after it, leading VAR=value words dropped."""
    found = []
    for words in command_lines():
        while words and re.fullmatch(rf"{ENV_NAME}=.*", words[0]):
            words = words[1:]
        if words and words[0] in ("export", ".") or not words:
            continue
        if " ".join(words).startswith(program + " ") or words == [program]:
            found.append(words[len(program.split()):])
    return found


def flags(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("-") and w != "-"]


# ---- the sluice command -----------------------------------------------------------------------------
@cache
def help_text(command: str) -> str:
    result = CliRunner().invoke(cli, [*command.split(), "--help"])
    assert result.exit_code == 0, f"`sluice {command} --help` failed:\n{result.output}"
    return result.output


def has_option(help_output: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_output.split("Options:", 1)[-1]) is not None


def test_every_sluice_command_and_flag_in_the_readme_exists() -> None:
    lines = commands_of("sluice")
    assert len(lines) >= 8
    used = set()
    for words in lines:
        while words and words[0].startswith("-"):  # group options such as -v
            assert has_option(help_text(""), words[0]), f"sluice {words[0]}"
            words = words[1:]
        if not words:
            continue
        command = words[0]
        assert command in cli.commands, f"the README runs `sluice {command}`, which does not exist"
        used.add(command)
        for flag in flags(words[1:]):
            assert has_option(help_text(command), flag), f"`sluice {command}` has no {flag}"
    # The quick start shows the whole lifecycle of a batch.
    assert {"up", "submit", "status", "results", "cancel", "batches", "worker", "serve", "generate"} <= used


def test_exit_codes_match_the_help() -> None:
    readme = re.search(r"^Exit codes \(`sluice --help` lists the same\):(.*?)\n\n", README, re.M | re.S)
    assert readme, "the README lists the exit codes"
    helped = re.findall(r"^\s+(\d+)\s{2,}", help_text("").split("Exit codes:")[1], re.M)
    assert re.findall(r"`(\d+)`", readme[1]) == helped


def _commands_in(cell: str) -> list[str]:
    return [""] if cell.startswith("(all") else [c.strip() for c in cell.split(",")]


def _commands() -> dict[str, click.Command]:
    """Every command by its words ("" for the group, "server status" for a subcommand)."""
    found: dict[str, click.Command] = {"": cli}
    for name, c in cli.commands.items():
        found[name] = c
        if isinstance(c, click.Group):
            found |= {f"{name} {sub}": s for sub, s in c.commands.items()}
    return found


def test_flag_table_lists_every_option_with_its_default_and_variable() -> None:
    covered: set[tuple[str, str]] = set()
    commands = _commands()
    for row in table_with("Flag", "--max-num-seqs"):
        names = ticked(row["Flag"])
        for command in _commands_in(row["Commands"]):
            cmd = commands[command]
            for name in names:
                assert has_option(help_text(command), name), f"{command or 'sluice'} has no {name}"
            (param,) = {p for p in cmd.params if set(names) <= set(p.opts) | set(p.secondary_opts)}
            covered.add((command, param.name))
            _check_default(row["Default"], param, click.Context(cmd), f"{command} {names[0]}")
            envvar = param.envvar if isinstance(param, click.Option) else None
            assert ticked(row["Env var"]) == ([envvar] if envvar else []), f"{command} {names[0]}: {envvar}"
            if envvar:
                assert f"env var: {envvar}" in re.sub(r"\s+", " ", help_text(command)), envvar
    every = {(name, p.name) for name, c in commands.items() for p in c.params
             if isinstance(p, click.Option) and p.name != "help"}
    missing = sorted(f"sluice {c} --{n.replace('_', '-')}" for c, n in every - covered)
    assert not missing, f"the README's flag table misses {missing}"


def _check_default(cell: str, param: click.Parameter, ctx: click.Context, what: str) -> None:
    default = param.get_default(ctx)
    if param.required:
        assert cell == "required", f"{what} is required"
    elif isinstance(param, click.Option) and param.is_bool_flag:
        assert ("on" if default else "off") in cell.split(), f"{what}: the default is {'on' if default else 'off'}"
    elif default is not None:
        assert str(default) in ticked(cell), f"{what}: the default is {default!r}, the README says {cell!r}"


# ---- environment variables ---------------------------------------------------------------------------
def _sources() -> str:
    return "\n".join(p.read_text() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _read_by_sluice() -> set[str]:
    """Every SLUICE_* name the packages read: the settings' fields, and the names spelled as strings
    (click's envvar, os.environ)."""
    from sluice.api.settings import Settings
    from sluice.jobs.settings import env_names

    return set(re.findall(r"""["'](SLUICE_[A-Z0-9_]+)["']""", _sources())) | set(env_names(Settings))


def _flag_variables() -> set[str]:
    return {v for r in table_with("Flag", "--max-num-seqs") for v in ticked(r["Env var"])}


def _names_in_readme() -> set[str]:
    spans = {s for s in re.findall(r"`([^`\n]+)`", README) if re.fullmatch(ENV_NAME, s)}
    assigned = set(re.findall(rf"\b({ENV_NAME})=", README))
    expanded = set(re.findall(rf"\$\{{?({ENV_NAME})", README))
    read = set(re.findall(rf"""environ\.get\(["']({ENV_NAME})["']""", README))
    return spans | assigned | expanded | read


def _compose_variables() -> set[str]:
    return set(re.findall(rf"(?<!\$)\$\{{({ENV_NAME})", (ROOT / "docker-compose.yml").read_text()))


def _script_variables() -> set[str]:
    text = "\n".join(p.read_text() for p in (ROOT / "scripts").glob("*.sh"))
    return set(re.findall(rf"\$\{{?({ENV_NAME})", text))


def _make_variables() -> set[str]:
    return set(re.findall(rf"^({ENV_NAME}) \??=", (ROOT / "Makefile").read_text(), re.M))


def test_every_environment_variable_the_readme_names_is_read_somewhere() -> None:
    names = _names_in_readme()
    assert {"SLUICE_HOME", "SLUICE_REDIS_URL", "SLUICE_API_KEY"} <= names
    known = _read_by_sluice() | _compose_variables() | _script_variables() | _make_variables() | set(THIRD_PARTY_ENV)
    assert not names - known, f"the README names variables nothing reads: {sorted(names - known)}"


def test_environment_tables_are_complete() -> None:
    sluice_vars = {ticked(r["Variable"])[0] for r in table_with("Variable", "`SLUICE_HOME`")}
    listed = sluice_vars | _flag_variables()
    assert not _read_by_sluice() - listed, f"missing from the tables: {sorted(_read_by_sluice() - listed)}"
    assert not sluice_vars - _read_by_sluice() - _script_variables() - set(THIRD_PARTY_ENV)
    compose_vars = {ticked(r["Variable"])[0] for r in table_with("Variable", "`SLUICE_KV_CACHE_MEMORY`")}
    assert compose_vars == _compose_variables()
    demo = " ".join(r["Setting"] for r in table_with("Setting", "DEMO_ARGS"))
    for name in ("SLUICE_DEMO_MODEL", "PYTHON", "DEMO_ARGS"):
        assert f"`{name}`" in demo


def test_environment_defaults_match_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    from sluice.api.settings import Settings

    for name in _read_by_sluice():
        monkeypatch.delenv(name, raising=False)
    s = Settings()
    rows = {ticked(r["Variable"])[0]: r["Default"] for r in table_with("Variable", "`SLUICE_HOME`")}
    for name, value in {"SLUICE_MAX_UPLOAD_BYTES": s.max_upload_bytes, "SLUICE_MAX_BATCH_LINES": s.max_batch_lines,
                        "SLUICE_MAX_PROMPT_CHARS": s.max_prompt_chars}.items():
        assert ticked(rows[name]) == [str(value)], name
    compose = (ROOT / "docker-compose.yml").read_text()
    for r in table_with("Variable", "`SLUICE_KV_CACHE_MEMORY`"):
        name, cell = ticked(r["Variable"])[0], r["Default"]
        m = re.search(rf"\$\{{{name}:([-?])([^}}]*)\}}", compose)
        assert m, name
        assert (m[1] == "?" and cell == "required") or (ticked(cell) == [m[2]] if m[2] else cell.startswith("empty"))


# ---- metrics ------------------------------------------------------------------------------------------
def _exported(families: list) -> dict[str, str]:  # type: ignore[type-arg]
    """Exposed name -> type (a counter's samples carry _total)."""
    return {f.name + ("_total" if f.type == "counter" else ""): f.type for f in families}


def test_metrics_table_matches_the_registries() -> None:
    from prometheus_client import CollectorRegistry
    from sluice.api.metrics import JobPlaneCollector, OpenAIMetrics, make_registry
    from sluice.worker.metrics import WorkerMetrics

    worker = _exported(list(WorkerMetrics("q", "w").registry.collect()))
    _, requests = make_registry(lambda: None)  # type: ignore[arg-type,return-value]
    api = _exported([*JobPlaneCollector(lambda: None).describe(), *requests.describe()])  # type: ignore[arg-type,return-value]
    online = OpenAIMetrics(CollectorRegistry())
    api |= _exported([*online.latency.describe(), *online.ttft.describe()])
    rows = {ticked(r["Metric"])[0]: r for r in table_with("Metric", "`sluice_job_server_up`")}
    for name, r in rows.items():
        by = {w.strip() for w in r["Exported by"].split(",")}
        assert by == {who for who, names in (("API", api), ("worker", worker)) if name in names}, name
        assert r["Type"] == (api.get(name) or worker.get(name)), name
    assert set(rows) == set(api) | set(worker), sorted(set(api) ^ set(worker) ^ set(rows))
    for name, kind in {**api, **worker}.items():  # the naming guide
        assert name.startswith("sluice_") and name.endswith("_total") == (kind == "counter"), name
        assert "per_second" not in name, f"{name}: rates are PromQL's"


# ---- other programs: make, scripts, docker compose -----------------------------------------------------
def test_make_targets_and_scripts_exist() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = [w[0] for w in commands_of("make") if w]
    assert {"demo", "test", "install", "bench"} <= set(targets)
    for target in targets:
        assert re.search(rf"^{target}:", makefile, re.M), f"no make target {target}"
    demo_help = subprocess.run(["bash", "scripts/demo.sh", "--help"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout
    for m in re.finditer(r'DEMO_ARGS="([^"]*)"', README):
        for flag in flags(shlex.split(m[1])):
            assert flag in demo_help, f"scripts/demo.sh has no {flag}"
    assert commands_of("bench/gpu_check.sh") and (ROOT / "bench" / "gpu_check.sh").exists()


def test_benchmark_flags_exist() -> None:
    lines = commands_of("python bench/throughput.py")
    assert lines
    out = subprocess.run([sys.executable, "bench/throughput.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    for words in lines:
        for flag in flags(words):
            assert has_option(out, flag), f"bench/throughput.py has no {flag}"


def test_docker_compose_commands_name_real_services_and_profiles() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    profiles = {p for s in services.values() for p in s.get("profiles", [])}
    lines = commands_of("docker compose")
    assert lines
    for words in lines:
        subcommand, rest = None, list(words)
        while rest:
            w = rest.pop(0)
            if w == "--profile":
                assert rest.pop(0) in profiles
            elif w.startswith("-"):
                continue
            elif subcommand is None:
                subcommand = w
            else:
                assert w in services, f"docker compose {' '.join(words)}: no service {w}"
    # The per-GPU services the README describes (worker-gpu2 is its how-to-add example, not in the file).
    named = set(re.findall(r"`(worker-gpu\d)`", README)) - {"worker-gpu2"}
    assert named and named <= set(services) and "--scale worker-gpu0=2" in README


# ---- paths and the architecture map -------------------------------------------------------------------
def test_paths_the_readme_names_exist() -> None:
    top = "|".join(["scripts", "docker", "bench", "tests", *PACKAGES])
    paths = set(re.findall(rf"(?<![\w/.~$-])((?:{top})/[\w./-]*)", README))
    # A run's output, and what bench/gpu_check.sh --prepare makes (both git-ignored): named, not shipped.
    generated = ("bench/out", "bench/gpu-check-tokenizer")
    paths = {p.rstrip(".") for p in paths if not p.startswith(generated)}
    assert "cli/samples/demo.jsonl" in paths and "jobs/keys.py" in paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"the README names paths that do not exist: {missing}"
    for name in ("docker-compose.yml", "Makefile"):
        assert f"`{name}`" in README and (ROOT / name).exists()


def test_architecture_map_covers_every_package() -> None:
    arch = section("Architecture")
    mapped = set(re.findall(r"^(\w+)/ ", arch, re.M))
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages <= mapped, f"missing from the architecture map: {sorted(packages - mapped)}"
    assert all((ROOT / d).is_dir() for d in mapped)


def test_readme_is_the_front_door() -> None:
    """The README keeps the pitch, the two commands and a quick start, and links to the docs for the rest."""
    readme = text("README.md")
    assert len(readme.splitlines()) <= 300
    for title in ("Two commands", "Quick start", "Documentation"):
        assert re.search(rf"^## {title}$", readme, re.M), title
    assert "make demo" in readme and "sluice generate cli/samples/demo.jsonl" in readme


@pytest.mark.parametrize(("page", "titles"), [
    ("docs/index.md", ["Why continuous batching"]),
    ("docs/getting-started.md", ["Two commands", "Quick start (CLI)"]),
    ("docs/configuration.md", ["Environment variables", "docker-compose variables", "Flags"]),
    ("docs/http-api.md", ["The HTTP API with the OpenAI SDK", "Using Sluice as an OpenAI endpoint", "Responses API"]),
    ("docs/deployment.md", ["docker-compose", "Running on Kubernetes", "Running on a Redis Cluster", "Celery"]),
    ("docs/monitoring.md", ["Metrics", "Tracing", "Dashboard"]),
    ("docs/models.md", ["Tensor parallelism", "Quantized weights"]),
    ("docs/lora.md", ["Adapters loaded on demand"]),
    ("docs/embeddings.md", ["Score and rerank"]),
    ("docs/reliability.md", ["Retries and dead letters"]),
    ("ARCHITECTURE.md", ["Architecture", "The path of a job", "Redis layout and sharding"]),
])
def test_docs_sections(page: str, titles: list[str]) -> None:
    for title in titles:
        assert re.search(rf"^#+ {re.escape(title)}$", text(page), re.M), f"{page} has no section {title!r}"


def test_benchmark_tables_sit_beside_their_commands() -> None:
    bench = text("docs/benchmarks.md")
    assert "python bench/throughput.py" in bench and "| Sluice continuous" in bench
    from sluice.jobs import keys

    assert "{<batch_id>}" in section("Redis layout and sharding") and "{<batch_id>}" in (keys.__doc__ or "")


# ---- the OpenAI SDK example, run --------------------------------------------------------------------
def test_openai_example_runs_against_a_live_api(tiny_model_dir: Path, tmp_path: Path) -> None:
    from cli_api_helpers import sluice_home, start_sluice, stop, tiny_worker, wait_for_url

    (example,) = [body for lang, body in code_blocks() if lang == "python" and "from openai import" in body]
    assert 'base_url="http://127.0.0.1:8000/v1"' in example
    key = "sk-readme"
    with sluice_home(tmp_path / "home"), tiny_worker(tiny_model_dir, queue="tiny"):
        log = tmp_path / "serve.log"
        proc = start_sluice("serve", "--port", "0", "--log-level", "warning", log=log,
                            env={**os.environ, "SLUICE_API_KEY": key})
        try:
            url = wait_for_url(proc, log, timeout=60)
            code = example.replace("http://127.0.0.1:8000", url)
            run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SLUICE_API_KEY": key},
                                 capture_output=True, text=True, timeout=120)
        finally:
            assert stop(proc) == 0, log.read_text()
    assert run.returncode == 0, run.stderr
    assert {"q0", "q1"} <= set(re.findall(r"^(q\d+) ", run.stdout, re.M)), run.stdout


# ---- the Datasets CLI example, run ------------------------------------------------------------------
def test_datasets_cli_example_runs(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The first shell block of the Datasets section, as it stands, in an empty folder; the model and its
    settings come from their environment variables (SLUICE_MODEL: the tiny model)."""
    import pyarrow.parquet as pq

    datasets = text("docs/datasets.md")
    (example, *_) = [body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", datasets, re.M | re.S)
                     if lang == "bash"]
    assert "sluice generate texts.parquet" in example
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "SLUICE_MODEL": str(tiny_model_dir), "SLUICE_DTYPE": "float32", "SLUICE_KV_CACHE_MEMORY": "16MiB"}
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", example], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=1800)  # a first build of the C++ ops can take minutes
    assert run.returncode == 0, run.stderr
    out = pq.read_table(tmp_path / "texts.out.parquet").to_pylist()
    assert [r["id"] for r in out] == ["a", "b"] and all(r["error"] is None and r["completion"] for r in out)
    assert "2 rows: 2 completed, 0 failed" in run.stderr
    assert re.search(r"^0\s+a\s", run.stdout, re.M) and re.search(r"^1\s+b\s", run.stdout, re.M), run.stdout


def test_datasets_python_example_calls_what_the_api_has() -> None:
    """The notebook example needs a model and a job server to run; here every call it makes is checked
    against the API: the function or method exists and takes each keyword it is given."""
    import ast
    import inspect

    from sluice.jobs.schemas import SamplingParams

    import sluice

    datasets = text("docs/datasets.md")
    (example,) = [body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", datasets, re.M | re.S) if lang == "python"]
    owners = {"sluice": sluice, "batch": sluice.Batch}
    checked = []
    for node in ast.walk(ast.parse(example)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name) and node.func.value.id in owners:
            f = getattr(owners[node.func.value.id], node.func.attr)
            params = inspect.signature(f).parameters
            # **sampling: the keywords are SamplingParams' fields (max_tokens=24)
            sampling = set(SamplingParams.model_fields) if any(p.kind is p.VAR_KEYWORD for p in params.values()) else set()
            for kw in node.keywords:
                assert kw.arg in params or kw.arg in sampling, f"{node.func.value.id}.{node.func.attr} takes no {kw.arg}="
            checked.append(f"{node.func.value.id}.{node.func.attr}")
    assert {"sluice.generate", "sluice.submit", "batch.wait", "batch.to_pandas"} <= set(checked), checked
    assert all(hasattr(sluice.Batch, m) for m in ("to_arrow", "to_polars", "to_dataset", "write"))  # named in a comment
