"""Row -> request: a dataset row rendered as one simple request line (the JSONL ``submit`` and
``sluice generate`` read), or a RowError naming the row when it does not render.

The text comes from a prompt column, a messages column, a ``str.format`` template over the row's
columns (``'Summarise: {text}'``) or a Jinja template file; without any, a ``messages`` or ``prompt``
column is used. Columns named like sampling fields (``temperature``, ``max_tokens``, ...) set that
row's sampling; the id column (default: the row number) is the request's custom_id.
"""

from __future__ import annotations

import base64
import json
import os
import re
import string
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from typing import Any

from sluice.jobs.datasets.extras import need
from sluice.jobs.datasets.readers import Source, json_default, open_source
from sluice.jobs.lines import LineError, normalize_messages, parse_line
from sluice.jobs.schemas import SAMPLING_FIELDS

# Per-row settings read from columns of these names (None / empty text: not set for that row).
ROW_SETTINGS = frozenset(SAMPLING_FIELDS | {"response_format"})


class SpecError(ValueError):
    """A RowSpec that cannot work for this source (a column it names is not there, a bad template);
    a user error, found before any row is read."""


@dataclass(frozen=True)
class RowSpec:
    """How a row becomes a request. At most one of ``prompt_column``, ``messages_column``, ``template``,
    ``template_file``; with none, the row's ``messages`` column, else its ``prompt`` column."""

    prompt_column: str | None = None
    messages_column: str | None = None
    template: str | None = None  # str.format over the row's columns: 'Summarise: {text}'
    template_file: str | None = None  # a Jinja template (path or fsspec URL); the row's columns are its variables
    system: str | None = None  # a system message before the text (chat only)
    id_column: str | None = None  # its value (text or integer) is the custom_id; default: the row number
    model_column: str | None = None  # its text is the row's model: "BASE:ADAPTER" or a bare adapter runs a LoRA
    chat: bool = True  # the text is the user's message (False: a raw completion prompt)
    sampling_columns: bool = True  # per-row settings from columns named like sampling fields
    embed: bool = False  # the text is an embedding input (an embedding model's rows), not a prompt
    image_column: str | None = None  # image bytes, a path or a URL: an image part of the row's user message

    def __post_init__(self) -> None:
        given = [k for k in ("prompt_column", "messages_column", "template", "template_file") if getattr(self, k)]
        if len(given) > 1:
            raise SpecError(f"give one of prompt_column, messages_column, template, template_file (got {', '.join(given)})")
        if self.system is not None and not self.chat:
            raise SpecError("system needs chat requests (chat=True)")
        if self.image_column and (self.embed or not self.chat):
            raise SpecError("image_column needs chat requests to a vision-language model (chat=True)")
        if self.embed and (self.messages_column or self.system is not None):
            raise SpecError("an embedding model's rows are text to embed: give a prompt_column or template, "
                            "not messages_column or system")
        if self.template is not None:
            try:
                parts = list(string.Formatter().parse(self.template))
                names = [f for _, f, _, _ in parts if f]  # with the fields nested in a format spec ({x:{w}})
                names += [f for _, _, fs, _ in parts if fs for _, f, _, _ in string.Formatter().parse(fs) if f]
            except ValueError as e:
                raise SpecError(f"template: {e}") from None
            private = [f for f in names if any(a.startswith("_") for a in re.findall(r"\.([^.\[]*)", f))]
            if private:  # str.format reaches any attribute: '{text.__class__}' would read the interpreter's insides
                raise SpecError(f"template: field {{{private[0]}}} reads a private attribute")

    def columns_used(self) -> list[str]:
        """Columns every row must have (a template's fields; the prompt, messages and id columns)."""
        cols = [c for c in (self.prompt_column, self.messages_column, self.id_column, self.model_column,
                            self.image_column) if c]
        if self.template:
            cols += [_top_field(f) for _, f, _, _ in string.Formatter().parse(self.template) if f]
        return list(dict.fromkeys(cols))


@dataclass
class Request:
    row: int  # from 0
    custom_id: str
    line: str  # a simple request line: {"custom_id", "messages"|"prompt", per-row settings}


@dataclass
class RowError:
    row: int
    custom_id: str | None  # None when the id itself is what is wrong
    code: str
    message: str

    def __str__(self) -> str:
        return f"row {self.row}: {self.message}"


class _Bad(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def read_requests(source: str | os.PathLike[str] | Source, spec: RowSpec | None = None, *,
                  skip: Container[str] | Callable[[str], bool] | None = None, validate: bool = True,
                  rows: int = 4096) -> Iterator[Request | RowError]:
    """Each row of ``source`` as a Request, or a RowError naming it, in row order.

    ``skip``: custom_ids already done (``ResultsWriter.done`` on a resume): not yielded. ``validate``
    parses each line as ``submit`` will, so a bad value (``temperature: "hot"``) is this row's error
    here, by row number, rather than a later line number. Raises SpecError before the first row when a
    column the spec names is missing from a source that has a schema.
    """
    spec = spec or RowSpec()
    src = source if isinstance(source, Source) else open_source(source)
    render = RowRenderer(spec, None if src.format == "jsonl" else src.column_names())
    is_done = skip if callable(skip) else (skip.__contains__ if skip is not None else None)
    seen: set[str] = set()  # only with an id column: row numbers cannot repeat
    for block in src.blocks(rows):
        for i, row in enumerate(block.rows()):
            n = block.start + i
            if row is None:
                yield RowError(n, None, "invalid_line", block.bad.get(i, "not a row"))
                continue
            try:
                cid = row_id(row.get(spec.id_column) if spec.id_column else n, spec.id_column)
            except _Bad as e:
                yield RowError(n, None, e.code, e.message)
                continue
            if spec.id_column:
                if cid in seen:
                    yield RowError(n, None, "duplicate_custom_id", f"id {cid!r} ({spec.id_column}) appears twice")
                    continue
                seen.add(cid)
            if is_done is not None and is_done(cid):
                continue
            try:
                yield Request(n, cid, render.line(row, n, cid, validate))
            except _Bad as e:
                yield RowError(n, cid, e.code, e.message)


def row_id(value: Any, id_column: str | None) -> str:
    """The custom_id of a row: its row number, or its id column's text or integer."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and value:
        return value
    what = "missing" if value is None else "empty" if value == "" else f"a {type(value).__name__}"
    raise _Bad("invalid_custom_id", f"id column {id_column!r} is {what} (must be text or an integer)")


def safe_row_id(value: Any, id_column: str | None) -> str | None:
    try:
        return row_id(value, id_column)
    except _Bad:
        return None


class RowRenderer:
    """A RowSpec, checked against the source's columns once and compiled (a Jinja template) once."""

    def __init__(self, spec: RowSpec, columns: list[str] | None) -> None:
        self.spec = spec
        if columns is not None:
            have = f"(columns: {', '.join(columns) or 'none'})"
            lacking = [c for c in spec.columns_used() if c not in columns]
            if lacking:
                raise SpecError(f"no column {lacking[0]!r} in the source {have}")
            if not (spec.prompt_column or spec.messages_column or spec.template or spec.template_file) and \
                    "messages" not in columns and "prompt" not in columns:
                raise SpecError(f"no column 'prompt' or 'messages' in the source {have}: name the prompt or "
                                "messages column, or give a template")
        self.jinja = _jinja_template(spec.template_file) if spec.template_file else None
        # A column the text is made of is not also a setting ("Write {n} words" must not ask for n samples).
        self.used = set(spec.columns_used()) | (_jinja_names(self.jinja) if self.jinja is not None else set())
        self.settings = None if columns is None else [c for c in columns if c in ROW_SETTINGS and c not in self.used]

    def line(self, row: dict[str, Any], n: int, custom_id: str, validate: bool) -> str:
        obj: dict[str, Any] = {"custom_id": custom_id}
        messages = None if self.spec.embed else self._messages(row)
        if self.spec.embed:
            obj["input"] = self._text(row)
        elif messages is not None:
            obj["messages"] = messages
        else:
            text = self._text(row)
            if self.spec.chat:
                obj["messages"] = self._with_system([], text)
            else:
                obj["prompt"] = text
        if self.spec.image_column:
            obj["messages"] = with_image(obj["messages"], image_url(row, self.spec.image_column))
        if self.spec.sampling_columns and not self.spec.embed:  # an embedding line takes no sampling
            obj.update(self._settings(row))
        if self.spec.model_column:
            obj.update(self._model(row))
        line = json.dumps(obj, ensure_ascii=False, default=json_default)
        if validate:
            try:
                parse_line(line, n + 1)
            except LineError as e:
                raise _Bad(e.code, e.message) from None
        return line

    def _messages(self, row: dict[str, Any]) -> list[dict[str, Any]] | None:
        spec = self.spec
        col = spec.messages_column
        if col is None and not (spec.prompt_column or spec.template or spec.template_file) and \
                row.get("messages") is not None:
            col = "messages"
        if col is None:
            return None
        value = _value(row, col)
        if isinstance(value, str):  # a CSV or text column holding the messages as JSON
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise _Bad("invalid_messages", f"column {col!r} is text that is not JSON messages") from None
        try:
            messages = normalize_messages(_drop_nulls(value))
        except ValueError as e:
            raise _Bad("invalid_messages", f"column {col!r}: {e}") from None
        if spec.system is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": spec.system})
        return messages

    def _text(self, row: dict[str, Any]) -> str:
        spec = self.spec
        if spec.template is not None:
            return _format(spec.template, row)
        if self.jinja is not None:
            return _render_jinja(self.jinja, row)
        col = spec.prompt_column or "prompt"
        value = _value(row, col)
        if not isinstance(value, str):
            raise _Bad("invalid_prompt", f"column {col!r} is a {type(value).__name__}, not text")
        return value

    def _with_system(self, messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
        if self.spec.system is not None:
            messages.append({"role": "system", "content": self.spec.system})
        messages.append({"role": "user", "content": text})
        return messages

    def _model(self, row: dict[str, Any]) -> dict[str, Any]:
        """The row's model (null or empty: the engine's own, no adapter)."""
        col = self.spec.model_column
        assert col is not None
        value = row.get(col)
        if value is None or value == "":
            return {}
        if not isinstance(value, str):
            raise _Bad("invalid_model", f"column {col!r} is a {type(value).__name__}, not a model name")
        return {"model": value}

    def _settings(self, row: dict[str, Any]) -> dict[str, Any]:
        names = self.settings if self.settings is not None else [
            k for k in row if k in ROW_SETTINGS and k not in self.used]
        return {k: row[k] for k in names if row.get(k) is not None and row.get(k) != ""}


def image_url(row: dict[str, Any], col: str) -> str:
    """The row's image as an image part's URL: bytes as a data: URL; a path or URL as it is (the engine
    reads it only under the worker's --image-url-prefix, as a chat line's)."""
    value = _value(row, col)
    if isinstance(value, dict):  # a Hugging Face datasets Image: {"bytes", "path"}
        value = value.get("bytes") or value.get("path")
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        return f"data:{_image_mime(data)};base64,{base64.b64encode(data).decode()}"
    if isinstance(value, str) and value:
        return value
    raise _Bad("invalid_image", f"column {col!r} is a {type(value).__name__}, not image bytes, a path or a URL")


# An image's first bytes -> its type (the data: URL names one; the engine decodes whatever it is).
_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8", "image/jpeg"), (b"GIF8", "image/gif"), (b"BM", "image/bmp"),
          (b"RIFF", "image/webp"), (b"II*\x00", "image/tiff"), (b"MM\x00*", "image/tiff"))


def _image_mime(data: bytes) -> str:
    return next((mime for magic, mime in _MAGIC if data.startswith(magic)), "application/octet-stream")


def with_image(messages: list[dict[str, Any]], url: str) -> list[dict[str, Any]]:
    """``messages`` with the image leading the last user message's content (its text after it)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last is None:
        raise _Bad("invalid_messages", "an image column needs a user message to attach the image to")
    content = messages[last].get("content")
    parts = content if isinstance(content, list) else [] if content in (None, "") else [{"type": "text", "text": content}]
    out = list(messages)
    out[last] = {**messages[last], "content": [{"type": "image_url", "image_url": {"url": url}}, *parts]}
    return out


def _value(row: dict[str, Any], col: str) -> Any:
    if col not in row:
        raise _Bad("missing_column", f"no column {col!r}")
    if row[col] is None:
        raise _Bad("missing_value", f"column {col!r} is empty (null)")
    return row[col]


def _drop_nulls(messages: Any) -> Any:
    """Arrow gives every struct field to every message (``tool_calls: None``): drop the absent ones."""
    if not isinstance(messages, list):
        return messages
    return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]


def _top_field(field: str) -> str:
    """``text`` of ``{text}``, ``{text!r}``, ``{meta[title]}``, ``{meta.title}``."""
    return field.split("[", 1)[0].split(".", 1)[0]


def _format(template: str, row: dict[str, Any]) -> str:
    for _, f, _, _ in string.Formatter().parse(template):
        if f is not None:
            if not f or f.isdigit():
                raise _Bad("invalid_template", "the template has a positional field {}: name a column")
            _value(row, _top_field(f))
    try:
        return template.format_map(row)
    except (KeyError, IndexError, AttributeError, ValueError, TypeError) as e:
        raise _Bad("invalid_template", f"the template does not render for this row: {type(e).__name__}: {e}") from None


def _jinja_template(url: str) -> Any:
    need("jinja2", "template files")
    import jinja2
    import jinja2.sandbox
    from sluice.jobs.datasets.readers import url_to_fs

    fs, path = url_to_fs(url, {})
    try:
        with fs.open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise SpecError(f"template file {url}: {e}") from None
    # Sandboxed: a template is data (a file, a URL), and a plain Environment runs whatever Python it reaches.
    env = jinja2.sandbox.SandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False,
                                              keep_trailing_newline=False)
    try:
        template: Any = env.from_string(text)  # carries its source text (sluice_source) for the record
        template.sluice_source = text
        return template
    except jinja2.TemplateSyntaxError as e:
        raise SpecError(f"template file {url}, line {e.lineno}: {e.message}") from None


def _jinja_names(template: Any) -> set[str]:
    """The variables a Jinja template reads (its source is kept on the template for this)."""
    import jinja2.meta

    return set(jinja2.meta.find_undeclared_variables(template.environment.parse(template.sluice_source)))


def _render_jinja(template: Any, row: dict[str, Any]) -> str:
    import jinja2
    import jinja2.sandbox

    try:
        return template.render({"row": row, **row})
    except jinja2.sandbox.SecurityError as e:
        raise _Bad("unsafe_template", f"the template is refused: {e}") from None
    except jinja2.UndefinedError as e:
        raise _Bad("missing_column", f"the template needs {e.message}") from None
    except Exception as e:  # noqa: BLE001 - a row's values can break a template in any way: that row fails
        raise _Bad("invalid_template", f"the template does not render for this row: {type(e).__name__}: {e}") from None
