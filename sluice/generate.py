"""``sluice.generate``: rows through the engine in this process, no job server (``sluice generate``'s
path, worker/generate_rows.py). Requests are read from the source as the engine has room for them, and
each result is joined to its row as it finishes, so neither the rows nor their requests are all in
memory at once."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sluice.data import Data, joined, like, row_spec, sampling_defaults, source_of
from sluice.engine.config import check_engine_options  # a plain module (no torch)


def generate(data: Data, *, model: str | None = None, prompt_column: str | None = None,
             messages_column: str | None = None, template: str | None = None, template_file: str | None = None,
             system: str | None = None, id_column: str | None = None, model_column: str | None = None,
             image_column: str | None = None,
             chat: bool = True, output: str | None = None, resume: bool = False, progress: bool = True,
             llm: Any = None, lora: dict[str, str] | None = None, engine_options: dict[str, Any] | None = None,
             storage_options: dict[str, Any] | None = None, **sampling: Any) -> Any:
    """Generate for every row of ``data``; returns ``data`` with the result columns added (same kind:
    DataFrame, Dataset, list of dicts; a pyarrow Table for a file), or, with ``output`` (a path or fsspec
    URL of a .parquet/.jsonl/.csv file), writes there and returns a WriteSummary.

    The text: ``prompt_column``, ``messages_column``, a ``template`` over the row's columns
    (``"Summarise: {text}"``) or a Jinja ``template_file``; without any, a ``messages`` or ``prompt``
    column. ``system`` leads each chat; ``id_column`` names rows (default: row number). Keyword
    sampling settings (``max_tokens=64, temperature=0.7``) apply to every row; columns named like them
    set their own row's. ``resume`` (with ``output``) skips rows a killed run already wrote.
    With an embedding model (or ``llm`` an EmbeddingEngine) each row's text is embedded instead: an
    ``embedding`` column, no sampling. ``llm`` reuses a loaded ``sluice.engine.llm.LLM``; otherwise ``model``
    is loaded with ``engine_options`` (``sluice.engine.config.EngineConfig``'s settings by name; an unknown or
    ill-typed one is a ValueError) and the LoRA adapters ``lora`` (``{"name": "peft/folder"}``, as ``--lora``):
    a row whose ``model_column`` names ``"BASE:NAME"`` (or ``"NAME"``) runs on adapter NAME.
    ``image_column``: each row's image (bytes, a path or a URL) leads its user message, for a
    vision-language model (paths and URLs only under the engine's ``image_url_prefixes``).
    ``storage_options`` go to fsspec for a URL ``data`` and ``output`` (``{"endpoint_url": ...}`` for an
    S3-compatible store).
    """
    source = source_of(data, storage_options)
    embed = _embeds(model, llm)
    spec = replace(row_spec(prompt_column, messages_column, template, template_file, system, id_column, chat,
                            model_column, image_column), embed=embed)
    defaults = sampling_defaults(sampling)
    options = _with_lora(engine_options, lora, llm)
    check_engine_options(options)  # an unknown or ill-typed option: one ValueError now, not after reading rows
    from sluice.engine.factory import build_engine
    from sluice.worker.generate_rows import generate_rows  # the engine side: torch only when generating

    with joined(source, spec, output, resume, storage_options=storage_options, embeddings=embed) as (writer, table):
        summary = generate_rows(source, spec, writer, lambda: llm if llm is not None else build_engine(model, options),
                                defaults=defaults, resume=resume, progress=progress)
        return summary if output is not None else like(table(), data)


def _with_lora(engine_options: dict[str, Any] | None, lora: dict[str, Any] | None, llm: Any) -> dict[str, Any]:
    """``engine_options`` with the adapters of ``lora`` (names checked as ``--lora`` checks them)."""
    from sluice.jobs.keys import parse_lora_module

    if not lora:
        return dict(engine_options or {})
    if llm is not None:
        raise ValueError("lora= loads adapters with the model: give lora_modules= to the LLM passed as llm=")
    modules = dict(parse_lora_module(f"{name}={path}") for name, path in lora.items())
    return {**(engine_options or {}), "lora_modules": modules}


def _embeds(model: str | None, llm: Any) -> bool:
    """Whether the rows are embedded (an embedding model: an ``embedding`` column) rather than generated."""
    if llm is not None:
        return getattr(llm, "serves", "generation") == "embedding"
    from sluice.engine.embedding_model import is_embedding_model

    return is_embedding_model(model)
