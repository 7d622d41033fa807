"""How long torch's OpenMP threads spin after a parallel region before they sleep, for an embedding run.

torch on Linux runs its threads on GNU OpenMP (libgomp), whose idle threads spin for 300,000 rounds
(around a millisecond or more) after every parallel region unless told otherwise. An encoder's forward pass is a
chain of short regions with Python in between, and on a machine that other processes load too, a
spinning thread takes the core its own partner (or a neighbour) needs: the same 500 passages of
all-MiniLM-L6-v2 took 15-19 CPU-seconds with the default and 8-10 with a spin of 1,000 rounds or
none (OMP_WAIT_POLICY=PASSIVE), at load average ~9 on 2 cores (bench/embed_throughput.py's child,
interleaved; bench/embed_throughput.py's vLLM, on Intel's OpenMP, lost far less under that load).
libgomp reads the setting once, when it loads (with torch), so it has to be in the environment before that: the
CLI sets it for an embedding model before it imports torch. A user's own OMP_WAIT_POLICY or
GOMP_SPINCOUNT wins. No torch import here, on purpose.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

SPINCOUNT = "1000"
USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
MINILM = "all-MiniLM-L6-v2"  # the wheel's model, by name (engine/embedding_model.py)


def is_embedding_model(model: str | None) -> bool:
    """Whether ``--model`` names an embedding model: the wheel's MiniLM or a sentence-transformers
    directory (one with modules.json)."""
    if model is None:
        return False
    return model.lower() == MINILM.lower() or (Path(model).expanduser() / "modules.json").is_file()


def short_omp_spin(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set GOMP_SPINCOUNT=SPINCOUNT in ``environ`` (the process's) unless the user set the wait policy or
    torch is already loaded (too late: libgomp has read it). Returns whether it set it."""
    env = os.environ if environ is None else environ
    if "torch" in sys.modules or any(k in env for k in USER_SETTINGS):
        return False
    env["GOMP_SPINCOUNT"] = SPINCOUNT
    return True
