"""The built wheel installs one top-level package, ``sluice`` (with ``sluice.engine``, ``sluice.jobs``, ...
mapped from the repository's folders), so a user's own ``jobs/`` or ``cli/`` folder cannot shadow ours."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("engine", "kernels", "worker", "jobs", "cli", "api", "sluice")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--disable-pip-version-check",
                        "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=600)
    if p.returncode != 0 and "No matching distribution" in p.stderr:
        pytest.skip(f"no build backend to be had here: {p.stderr.strip()[-300:]}")
    assert p.returncode == 0, p.stderr
    (whl,) = out.glob("sluice_llm-*.whl")
    return whl


def test_wheel_holds_every_module_under_sluice(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {n.split("/")[0] for n in names} == {"sluice", next(n.split("/")[0] for n in names if ".dist-info/" in n)}
    for folder in FOLDERS:
        for src in (ROOT / folder).rglob("*.py"):
            rel = src.relative_to(ROOT).as_posix()
            installed = rel if folder == "sluice" else f"sluice/{rel}"
            assert installed in names, f"{rel} is not in the wheel: add its package to pyproject.toml"
    assert "sluice/kernels/cpu/paged_attention.cpp" in names and "sluice/kernels/cpu/common.h" in names
    assert "sluice/api/templates/base.html" in names or any(n.startswith("sluice/api/templates/") for n in names)


def test_install_leaves_only_sluice_and_a_users_jobs_folder_does_not_shadow_it(wheel: Path, tmp_path: Path) -> None:
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    py = env / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    before = set(p.name for p in site.iterdir())
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)], check=True,
                   timeout=300)
    added = set(p.name for p in site.iterdir()) - before
    assert added == {"sluice", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, added
    # The dependencies come from this environment's site-packages (a path entry, so its own .pth files,
    # the editable install of this checkout among them, are not run).
    (site / "deps.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    user = tmp_path / "user"
    for name in ("jobs", "cli", "engine", "worker", "api", "kernels"):
        (user / name).mkdir(parents=True)
        (user / name / "__init__.py").write_text(f"raise ImportError('the user\\'s own {name}/ was imported')\n")
    code = ("import sluice, sluice.jobs.keys, sluice.cli.main, sluice.api.app; "
            "print(sluice.jobs.keys.__file__); print(sluice.cli.main.__file__)")
    p = subprocess.run([str(py), "-c", code], cwd=user, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    for line in p.stdout.split():
        assert line.startswith(str(site / "sluice")), line
