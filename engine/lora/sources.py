"""Where an adapter a line names is read from: the worker's registered folders (``--lora NAME=PATH``), else
its adapter roots (``--lora-root``: local folders or fsspec prefixes such as ``s3://bucket/adapters/``).

A name from a line is only ever one path component under a root: a plain name (letters, digits, ``._-``,
no ``..``), so no line can make the worker read outside the roots it was given. What an administrator put
under a root (a symlinked folder, say) is trusted as the root itself is.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sluice.engine.lora.adapters import CONFIG_FILE, SAFETENSORS_FILE, LoraError, one_line

_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def check_adapter_name(name: str) -> None:
    """Raise LoraError unless ``name`` is a plain adapter name: one path component, nothing to resolve."""
    if not isinstance(name, str) or not _PLAIN.fullmatch(name) or ".." in name:
        raise LoraError(f"LoRA adapter name {name!r} is not a plain name (letters, digits, '.', '_', '-'; "
                        f"no path, no '..', no URL): it is looked up under the adapter roots only")


def is_url(root: str) -> bool:
    return bool(_SCHEME.match(root))


def check_root(root: str) -> str:
    """A ``--lora-root`` as given, checked where that is cheap: a local one must be a folder."""
    if not root.strip():
        raise ValueError("--lora-root must not be empty")
    if not is_url(root) and not Path(root).is_dir():
        raise ValueError(f"--lora-root {root!r} is not a folder")
    return root


@contextmanager
def adapter_folder(name: str, path: str | None, roots: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    """(where it was found, a local folder holding its files) for adapter ``name``: its registered ``path``,
    else the first root with ``ROOT/name/adapter_config.json``; a remote one's two files are copied into a
    temporary folder, removed on exit. LoraError if it is nowhere."""
    if path is not None:
        yield path, path
        return
    check_adapter_name(name)
    for root in roots:
        if not is_url(root):
            local = Path(root) / name
            if (local / CONFIG_FILE).is_file():
                yield str(local), str(local)
                return
            continue
        found = _remote(name, root)
        if found is not None:
            fs, where = found
            with tempfile.TemporaryDirectory(prefix="sluice-lora-") as tmp:
                _copy(name, fs, where, tmp)
                yield _join(root, name), tmp
            return
    raise LoraError(f"LoRA adapter {name!r} is not registered and not under the adapter roots "
                    f"({', '.join(roots) or 'none configured'})")


def _join(root: str, name: str) -> str:
    return root.rstrip("/") + "/" + name


def _remote(name: str, root: str) -> tuple[Any, str] | None:
    """(filesystem, the adapter's folder in it) if ``ROOT/name/adapter_config.json`` exists there."""
    try:
        import fsspec
    except ImportError as e:
        raise LoraError(f"adapter root {root!r} needs fsspec ({one_line(e)}): pip install 'sluice-llm[datasets]' "
                        f"(and s3fs for s3://)") from None
    try:
        fs, base = fsspec.core.url_to_fs(root)
        where = base.rstrip("/") + "/" + name
        return (fs, where) if fs.isfile(where + "/" + CONFIG_FILE) else None
    except Exception as e:  # noqa: BLE001 - a store that cannot be reached fails the lines that need it
        raise LoraError(f"LoRA adapter {name!r}: cannot look under {root!r}: {one_line(e)}") from None


def _copy(name: str, fs: Any, where: str, tmp: str) -> None:
    try:
        for file in (CONFIG_FILE, SAFETENSORS_FILE):
            if fs.isfile(f"{where}/{file}"):
                fs.get_file(f"{where}/{file}", str(Path(tmp) / file))
    except Exception as e:  # noqa: BLE001
        raise LoraError(f"LoRA adapter {name!r}: cannot copy {where}: {one_line(e)}") from None
