"""The processed row schema (docs/architecture.md), checked where a later stage reads prepared data.

A row that prepare could not have written (a missing or non-finite `gold`, no `source` task name, a
non-text `prompt`) means the file was edited or comes from elsewhere: the reader stops with one line
naming `file:line` instead of failing later inside training or scoring.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pipeline.core.errors import InputError
from pipeline.core.files import json_problem, text_lines


def check_prepared_row(row: Any, location: str) -> dict[str, Any]:
    """`row` if it has the processed schema's fields with the right types; InputError otherwise."""
    if not isinstance(row, dict):
        raise InputError(f"{location}: expected a JSON object, got {type(row).__name__}; rerun the prepare stage")
    problem = _problem(row)
    if problem:
        raise InputError(f"{location}: {problem}; rows are written by the prepare stage (rerun it)")
    return row


NUMBER_TASKS = ("gsm8k", "arith", "countdown")  # the built-in tasks, whose gold is a number


def _problem(row: dict[str, Any]) -> str:
    gold = row.get("gold")
    if "gold" not in row:
        return "missing 'gold'"
    source = row.get("source")
    if not isinstance(source, str) or not source:
        return f"'source' = {source!r} is not a task name"
    number = isinstance(gold, (int, float)) and not isinstance(gold, bool) and math.isfinite(gold)
    if (source in NUMBER_TASKS or isinstance(gold, float)) and not number:
        return f"'gold' = {gold!r} is not a finite number"
    if gold is None or isinstance(gold, bool):
        return f"'gold' = {gold!r} is not an answer"
    for key in ("prompt", "question", "solution"):
        if not isinstance(row.get(key), str):
            return f"missing or non-text '{key}'"
    if not isinstance(row.get("id"), str):
        return "missing or non-text 'id'"
    return ""


def read_rows(path: str | Path, limit: int = 0) -> list[dict[str, Any]]:
    """The first `limit` rows (0 = all) of a prepared JSONL file, in file order; blank lines skipped.

    A missing file, a line that is not a JSON object, or a row without the processed schema
    (`pipeline.data.schema`: a finite `gold`, a known `source`, text fields) raises
    :class:`InputError` naming the file and line and the stage that writes it.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: not found (run the 'prepare' stage first)")
    rows: list[dict[str, Any]] = []
    for lineno, line in text_lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as exc:  # ValueError: also an integer of over 4,300 digits
            raise InputError(f"{path}:{lineno}: invalid JSON ({json_problem(exc)}); "
                             "re-run the 'prepare' stage") from None
        rows.append(check_prepared_row(row, f"{path}:{lineno}"))
        if limit and len(rows) >= limit:
            break
    return rows
