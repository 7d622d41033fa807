"""Property-based tests of the API generated from its served OpenAPI schema (schemathesis): whatever
the requests, no 5xx. In-process (ASGI) on a real embedded Valkey; no worker is needed for that."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from cli_api_helpers import sluice_home
from hypothesis import HealthCheck, seed, settings
from schemathesis.checks import not_a_server_error
from sluice.api.app import create_app
from sluice.api.settings import Settings

KEY = "sk-schema"
# Seeded so a failure replays: SLUICE_TEST_SEED=<printed seed>.
SEED = int(os.environ.get("SLUICE_TEST_SEED", random.randrange(2**31)))
FILES = Path(tempfile.mkdtemp(prefix="sluice-schema-files-"))

# Built at import, as schemathesis wants the schema then; the job server is only reached on the first
# request, by which time the fixture below has pointed SLUICE_HOME at the test's own embedded Valkey.
app = create_app(Settings(api_key=KEY, files_dir=FILES))
schema = schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.fixture(scope="module", autouse=True)
def job_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with sluice_home(tmp_path_factory.mktemp("schema") / "home"):
        yield
        app.state.sluice.close()
    shutil.rmtree(FILES, ignore_errors=True)


@schema.parametrize()
@seed(SEED)
@settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: schemathesis.Case) -> None:
    print(f"seed={SEED} (replay with SLUICE_TEST_SEED={SEED})")
    case.call_and_validate(headers={"Authorization": f"Bearer {KEY}"}, checks=[not_a_server_error])
