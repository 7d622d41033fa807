"""Writing a batch's outcomes: completed jobs to OUT, everything else (failed, cancelled and expired
jobs, rejected input lines) to ERR, one OpenAI batch output line each, flushed as it lands.

Resumable: lines already in OUT or ERR (matched by their ``id``) are not written again, and a torn
last line from an interrupted run is cut first, so rerunning the same command picks up where it stopped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

import click

from jobs.jsonl import values_in
from jobs.schemas import LineErrorInfo, Result, line_error_to_output_line, result_to_output_line


def default_output_path(input_file: Path) -> Path:
    """prompts.jsonl -> prompts.results.jsonl"""
    return input_file.with_name(f"{input_file.stem}.results{input_file.suffix or '.jsonl'}")


def default_errors_path(output: Path) -> Path:
    """results.jsonl -> results.errors.jsonl"""
    return output.with_name(f"{output.stem}.errors{output.suffix}") if output.suffix else \
        output.with_name(f"{output.name}.errors")


def _ids_in(path: Path) -> set[str]:
    return values_in(path, "id")


class ResultFiles:
    """OUT and ERR of one batch (ERR is created only when something goes to it)."""

    def __init__(self, out: Path, err: Path) -> None:
        self.out_path, self.err_path = out, err
        self.seen = _ids_in(out) | _ids_in(err)
        self.resumed_jobs = sum(1 for i in self.seen if not i.startswith("line-"))
        out.parent.mkdir(parents=True, exist_ok=True)
        self._out: IO[str] = out.open("a", encoding="utf-8")
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
            self.err_path.parent.mkdir(parents=True, exist_ok=True)
            self._err = self.err_path.open("a", encoding="utf-8")
        return self._err

    def _write(self, f: IO[str], line: dict[str, Any]) -> None:
        f.write(json.dumps(line, ensure_ascii=False) + "\n")
        f.flush()
        self.seen.add(line["id"])

    def close(self) -> None:
        self._out.close()
        if self._err is not None:
            self._err.close()

    def summary(self) -> str:
        where = f"-> {self.out_path}" + (f" (errors: {self.err_path})" if self.err_path.exists() else "")
        return f"{self.completed} completed, {self.failed} failed, {self.bad_lines} bad lines {where}"


def echo_line(res: Result) -> None:
    """A job's outcome line on stdout."""
    click.echo(json.dumps(result_to_output_line(None, res), ensure_ascii=False))
