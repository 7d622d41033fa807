"""Writing a batch's outcomes: completed jobs to OUT, everything else (failed, cancelled and expired
jobs, rejected input lines) to ERR, one OpenAI batch output line each, flushed as it lands.

Resumable: lines already in OUT or ERR (matched by their ``id``) are not written again, and a torn
last line from an interrupted run is cut first, so rerunning the same command picks up where it stopped.
OUT ``-`` is stdout (ERR too, unless given): nothing to resume there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

import click
from sluice.jobs.jsonl import values_in
from sluice.jobs.openai_output import line_error_to_output_line, result_to_output_line
from sluice.jobs.schemas import LineErrorInfo, Result

STDIO = "-"  # as a file name: stdin for an input, stdout for an output


def default_output_path(input_file: Path) -> Path:
    """prompts.jsonl -> prompts.results.jsonl"""
    return input_file.with_name(f"{input_file.stem}.results{input_file.suffix or '.jsonl'}")


def default_errors_path(output: Path) -> Path:
    """results.jsonl -> results.errors.jsonl (stdout stays stdout)"""
    if str(output) == STDIO:
        return output
    return output.with_name(f"{output.stem}.errors{output.suffix}") if output.suffix else \
        output.with_name(f"{output.name}.errors")


def _ids_in(path: Path) -> set[str]:
    return set() if str(path) == STDIO else values_in(path, "id")


class ResultFiles:
    """OUT and ERR of one batch (ERR is created only when something goes to it)."""

    def __init__(self, out: Path, err: Path) -> None:
        self.out_path, self.err_path = out, err
        self.seen = _ids_in(out) | _ids_in(err)
        self.resumed_jobs = sum(1 for i in self.seen if not i.startswith("line-"))
        self._owned: list[IO[str]] = []
        self._out = self._open(out)
        self._err: IO[str] | None = None
        self.completed = self.failed = self.bad_lines = 0
        self.tokens = 0

    def add_result(self, res: Result) -> bool:
        """Write one job's outcome; False if an earlier run already did."""
        line = result_to_output_line(None, res)
        if line["id"] in self.seen:
            return False
        ok = res.status == "completed"
        self._write(self._out if ok else self._errors(), line)
        self.completed += ok
        self.failed += not ok
        self.tokens += res.usage.completion_tokens
        return True

    def add_line_error(self, info: LineErrorInfo, custom_id: str | None = None) -> None:
        line = line_error_to_output_line(info, custom_id)
        if line["id"] not in self.seen:
            self._write(self._errors(), line)
            self.bad_lines += 1

    def _errors(self) -> IO[str]:
        if self._err is None:
            self._err = self._out if self.err_path == self.out_path else self._open(self.err_path)
        return self._err

    def _write(self, f: IO[str], line: dict[str, Any]) -> None:
        f.write(json.dumps(line, ensure_ascii=False) + "\n")
        f.flush()
        self.seen.add(line["id"])

    def _open(self, path: Path) -> IO[str]:
        if str(path) == STDIO:
            return click.get_text_stream("stdout")  # type: ignore[operator]  # click 8.5 types it object
        path.parent.mkdir(parents=True, exist_ok=True)
        f = path.open("a", encoding="utf-8")
        self._owned.append(f)
        return f

    def close(self) -> None:
        for f in self._owned:
            f.close()

    def summary(self) -> str:
        def name(p: Path) -> str:
            return "stdout" if str(p) == STDIO else str(p)

        errors = self.err_path != self.out_path and (str(self.err_path) == STDIO or self.err_path.exists())
        where = f"-> {name(self.out_path)}" + (f" (errors: {name(self.err_path)})" if errors else "")
        return f"{self.completed} completed, {self.failed} failed, {self.bad_lines} bad lines {where}"


def echo_line(res: Result) -> None:
    """A job's outcome line on stdout."""
    click.echo(json.dumps(result_to_output_line(None, res), ensure_ascii=False))
