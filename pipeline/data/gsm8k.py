"""Load, validate and convert GSM8K.

Sources (`data.gsm8k_source`):
- a Hugging Face dataset id (default `openai/gsm8k`, config `data.gsm8k_config`), loaded with
  `datasets`. The hub is probed first (3 s) so that an unreachable hub fails in seconds with an
  :class:`InputError` saying how to point at a local copy, instead of `datasets` retrying for ~30 s.
  With `HF_DATASETS_OFFLINE=1`/`HF_HUB_OFFLINE=1` only the local `datasets` cache is tried.
- a folder holding both splits: `train.jsonl` + `test.jsonl`, `train.parquet` + `test.parquet`,
  or hub-style shards `train-*.parquet` (also looked for in `<folder>/<gsm8k_config>/`, the layout of
  a hub snapshot). Two formats for one split is an error (ambiguous).
- a single `.jsonl`/`.parquet` file whose name names its split (`train` or `test`, e.g.
  `gsm8k_train.jsonl`): the other split is the sibling with that word swapped (`gsm8k_test.jsonl`),
  which must exist. Both splits are always needed: test is the final evaluation set.

JSONL is read line by line with `json` (not `datasets`, whose JSON reader rejects a whole file on one
bad line and loses line numbers), so every malformed row is reported as `file:line: reason`; Parquet
goes through `pyarrow.parquet` (in memory, no cache files; an empty file with the right schema is an
empty split) and is located as `file:row N`. Blank JSONL lines are skipped, a UTF-8 byte-order mark is
dropped.

Limits (memory stays bounded whatever the file holds): a file over MAX_FILE_BYTES, a line over
MAX_ROW_BYTES or a line that is not UTF-8 (say, a Latin-1 export) stops the stage with one line naming
`file:line`; a question or answer over MAX_TEXT_CHARS, or one holding a lone surrogate, is a malformed
row (counted against `data.max_bad_fraction`).

A valid row has a non-empty `question` and an `answer` whose text after the last `####` is one number:
an optional minus sign, digits with optional thousands commas (`1,234`), optional decimals.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pipeline.core.errors import InputError
from pipeline.core.files import did_you_mean, json_problem, text_lines
from pipeline.data.prompts import format_answer, format_prompt

SPLITS = ("train", "test")
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
MAX_ROW_BYTES = 64 * 1024  # one GSM8K row is under 2 kB; a longer line is not a GSM8K row
MAX_FILE_BYTES = 256 * 1024 * 1024
MAX_TEXT_CHARS = 16 * 1024  # a question or answer longer than this is refused (Parquet has no lines to cap)
_CALC_RE = re.compile(r"<<[^<>]*>>")
_LOCAL_HINT = ("point at a local copy with --set data.gsm8k_source=/path/to/gsm8k "
               "(a folder with train.jsonl and test.jsonl, or .parquet)")


@dataclass(frozen=True)
class RawRow:
    """One record as read from the source, before validation."""

    index: int  # 0-based position in its split (becomes the row id)
    location: str  # "file:line", "file:row N" or "hub-id:split[i]"
    data: Any  # the decoded record (a dict when well-formed)
    error: str = ""  # set when the record could not even be decoded (bad JSON)


@dataclass(frozen=True)
class BadRow:
    split: str
    location: str
    reason: str


# --------------------------------------------------------------------------- answers

def parse_gold(answer: str) -> float:
    """The number after the last `####` of a GSM8K answer; ValueError says what is wrong."""
    if "####" not in answer:
        raise ValueError("answer has no '#### N' final line")
    text = answer.rsplit("####", 1)[1].strip()
    if not _NUMBER_RE.fullmatch(text):
        raise ValueError(f"final answer {text[:30]!r} after '####' is not a number")
    value = float(text.replace(",", ""))
    if not math.isfinite(value):
        raise ValueError(f"final answer {text[:30]!r} is not finite")
    return value


def rewrite_solution(answer: str) -> str:
    """GSM8K answer -> SFT target: drop `<<calc>>` annotations, `#### N` -> `<answer>N</answer>`."""
    gold = parse_gold(answer)
    reasoning = _CALC_RE.sub("", answer.rsplit("####", 1)[0]).strip()
    return f"{reasoning}\n{format_answer(gold)}" if reasoning else format_answer(gold)


def _check_text(name: str, text: str) -> None:
    """ValueError if a field is too long or not encodable text (a lone surrogate such as `\\ud800`)."""
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(f"'{name}' is {len(text)} characters; at most {MAX_TEXT_CHARS}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"'{name}' holds a lone surrogate (U+{ord(text[exc.start]):04X}) at character "
                         f"{exc.start + 1}; not valid Unicode text") from None


def make_row(raw: RawRow, split: str, template: str) -> dict[str, Any]:
    """A processed row (docs/architecture.md schema); ValueError names what is malformed."""
    data = raw.data
    if raw.error:
        raise ValueError(raw.error)
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    question, answer = data.get("question"), data.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("missing or empty 'question'")
    if not isinstance(answer, str):
        raise ValueError("missing or non-text 'answer'")
    for name, text in (("question", question), ("answer", answer)):
        _check_text(name, text)
    gold = parse_gold(answer)
    return {"id": f"gsm8k-{split}-{raw.index:05d}", "source": "gsm8k", "question": question.strip(),
            "prompt": format_prompt(question, template), "gold": gold,
            "solution": rewrite_solution(answer), "level": 0}


def validate_split(raws: list[RawRow], split: str, template: str, max_bad_fraction: float,
                   where: str) -> tuple[list[dict[str, Any]], list[BadRow]]:
    """Convert every row; fail if more than `max_bad_fraction` of them are malformed."""
    rows, bad = [], []
    for raw in raws:
        try:
            rows.append(make_row(raw, split, template))
        except ValueError as exc:
            bad.append(BadRow(split, raw.location, str(exc)))
    if not raws:
        raise InputError(f"{where}: the {split} split has no rows")
    if len(bad) / len(raws) > max_bad_fraction:
        first = bad[0]
        raise InputError(
            f"{where}: {len(bad)} of {len(raws)} {split} rows are malformed "
            f"({len(bad) / len(raws):.2%} > data.max_bad_fraction = {max_bad_fraction:.2%}); "
            f"first: {first.location}: {first.reason}")
    return rows, bad


# --------------------------------------------------------------------------- sources

def _check_file_size(path: Path) -> None:
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise InputError(f"{path}: {size} bytes is more than a GSM8K split can be (at most {MAX_FILE_BYTES} bytes; "
                         "GSM8K train is ~4 MB); is this the right file?")


def read_jsonl(path: Path) -> list[RawRow]:
    _check_file_size(path)
    rows = []
    for lineno, line in text_lines(path, MAX_ROW_BYTES):
        if not line.strip():
            continue
        loc = f"{path}:{lineno}"
        try:
            rows.append(RawRow(len(rows), loc, json.loads(line)))
        except (ValueError, RecursionError) as exc:  # ValueError: also an integer of over 4,300 digits
            rows.append(RawRow(len(rows), loc, None, f"invalid JSON ({json_problem(exc)})"))
    return rows


def read_parquet(paths: list[Path]) -> list[RawRow]:
    """The question/answer columns of Parquet files (pyarrow, in memory, no cache files)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for path in paths:
        _check_file_size(path)
        try:
            table = pq.read_table(path, columns=[c for c in ("question", "answer")
                                                 if c in pq.read_schema(path).names])
        except (OSError, ValueError, pa.ArrowException) as exc:  # ArrowInvalid is a ValueError
            raise InputError(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0][:160]})") from None
        for i, rec in enumerate(table.to_pylist()):
            rows.append(RawRow(len(rows), f"{path}:row {i + 1}", rec))
    return rows


def _split_files(folder: Path, split: str) -> list[Path]:
    """The file(s) holding one split in `folder`, or [] when there are none."""
    found = {"jsonl": sorted(p for p in [folder / f"{split}.jsonl"] if p.is_file()),
             "parquet": sorted({*[p for p in [folder / f"{split}.parquet"] if p.is_file()],
                                *folder.glob(f"{split}-*.parquet")})}
    kinds = [k for k, v in found.items() if v]
    if len(kinds) > 1:
        raise InputError(f"{folder}: both {split}.jsonl and {split} Parquet files exist; keep one")
    return found[kinds[0]] if kinds else []


def local_split_files(source: Path, config: str) -> dict[str, list[Path]]:
    """Resolve a local file or folder source into the files of each split (see module doc)."""
    if source.is_dir():
        for folder in (source, source / config):
            files = {s: _split_files(folder, s) for s in SPLITS} if folder.is_dir() else {}
            if files and all(files.values()):
                return files
        raise InputError(f"{source}: expected train and test files in this folder "
                         "(train.jsonl + test.jsonl, train.parquet + test.parquet, or train-*.parquet shards)")
    if source.suffix not in (".jsonl", ".parquet"):
        raise InputError(f"{source}: unsupported file type; use .jsonl or .parquet, or a folder")
    named = [s for s in SPLITS if s in source.name]
    if len(named) != 1:
        raise InputError(f"{source}: a single file must name its split ('train' or 'test') and have its "
                         "sibling next to it (e.g. train.jsonl + test.jsonl); or point at the folder")
    split = named[0]
    other = "test" if split == "train" else "train"
    sibling = source.with_name(source.name.replace(split, other))
    if not sibling.is_file():
        raise InputError(f"{source}: the {other} split is missing; expected {sibling} next to it")
    return {split: [source], other: [sibling]}


def _looks_local(source: str) -> bool:
    """A hub id is `owner/name`; anything shaped like a path is reported as a missing path, and so is
    an `owner/name` whose `owner` is a folder here (`datasets/gsmk8`: a typo, not a hub id)."""
    return (source.startswith((".", "/", "~")) or source.endswith((".jsonl", ".parquet")) or source.count("/") > 1
            or ("/" in source and Path(source.split("/", 1)[0]).is_dir()))


def _hub_reachable(timeout: float = 3.0) -> bool:
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def _offline() -> bool:
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def read_hub(source: str, config: str) -> dict[str, list[RawRow]]:
    import datasets

    if not _offline() and not _hub_reachable():
        raise InputError(f"data.gsm8k_source = {source!r}: the Hugging Face Hub cannot be reached; "
                         f"{_LOCAL_HINT}, or set HF_DATASETS_OFFLINE=1 to use a cached copy")
    try:
        ds = datasets.load_dataset(source, config)
    except (OSError, ValueError) as exc:  # ConnectionError, DatasetNotFoundError, bad config name
        raise InputError(f"data.gsm8k_source = {source!r} (config {config!r}) could not be loaded "
                         f"({str(exc).splitlines()[0][:160]}); {_LOCAL_HINT}") from None
    missing = [s for s in SPLITS if s not in ds]
    if missing:
        raise InputError(f"data.gsm8k_source = {source!r}: no {'/'.join(missing)} split")
    return {s: [RawRow(i, f"{source}:{s}[{i}]", rec) for i, rec in enumerate(ds[s].to_list())]
            for s in SPLITS}


def load_raw(source: str, config: str = "main") -> dict[str, list[RawRow]]:
    """Every record of the train and test splits, unvalidated, with its location."""
    path = Path(source).expanduser()
    if path.exists():
        files = local_split_files(path, config)
        return {s: (read_jsonl(files[s][0]) if files[s][0].suffix == ".jsonl" else read_parquet(files[s]))
                for s in SPLITS}
    if _looks_local(source):
        raise InputError(f"data.gsm8k_source = {source!r}: no such file or folder "
                         f"(relative paths are resolved from {Path.cwd()}){did_you_mean(path)}")
    return read_hub(source, config)
