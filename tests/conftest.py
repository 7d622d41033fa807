"""Shared fixtures: tiny random Llama models built from a config (no download) and the SmolLM2 path."""

from __future__ import annotations

import os

# Triton kernels run under the interpreter on CPU; this must be set before any kernel is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from helpers import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer GQA Llama with random weights and SmolLM2's tokenizer, saved as a local directory."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)
