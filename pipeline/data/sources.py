"""Reading a task's source: a local JSONL, Parquet or CSV file, a folder of split files, or a hub dataset.

- a folder: one file per split, named after it (`train.jsonl`, `test.parquet`, `validation.csv`, or
  Parquet shards `train-*.parquet`); two formats for one split is an error (ambiguous);
- a single file: every row of it (the task's `test_fraction` makes the test split);
- a hub id `owner/name`: `datasets.load_dataset(id, config, revision=...)` (from the local cache only when
  offline).
Every record keeps all of its columns; JSONL lines and CSV rows keep their `file:line` for messages
(CSV values are text; a `number` answer reads its text). The size limits of :mod:`pipeline.data.gsm8k`
hold for every file.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from pipeline.core.errors import InputError
from pipeline.core.files import did_you_mean
from pipeline.data.gsm8k import MAX_ROW_BYTES, RawRow, _check_file_size, _offline, read_jsonl

FORMATS = (".jsonl", ".parquet", ".csv")


def read_parquet_rows(paths: list[Path]) -> list[RawRow]:
    """Every column of Parquet files (pyarrow, in memory), located as `file:row N`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for path in paths:
        _check_file_size(path)
        try:
            table = pq.read_table(path)
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise InputError(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0][:160]})") from None
        rows += [RawRow(len(rows), f"{path}:row {i + 1}", rec) for i, rec in enumerate(table.to_pylist())]
    return rows


def read_csv_rows(path: Path) -> list[RawRow]:
    """A CSV file with a header line; each row a dict of text values, located as `file:line`."""
    _check_file_size(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    reader = csv.DictReader(io.StringIO(text, newline=""))
    rows = []
    for rec in reader:
        line = reader.line_num
        if any(len(str(v)) > MAX_ROW_BYTES for v in rec.values() if v is not None):
            raise InputError(f"{path}:{line}: a value longer than {MAX_ROW_BYTES} characters")
        if None in rec:  # more values than header columns
            rows.append(RawRow(len(rows), f"{path}:{line}", None, f"{len(rec) - 1 + len(rec[None])} values for "
                                                                  f"{len(reader.fieldnames or [])} header columns"))
            continue
        rows.append(RawRow(len(rows), f"{path}:{line}", dict(rec)))
    return rows


def read_file(paths: list[Path]) -> list[RawRow]:
    suffix = paths[0].suffix
    if suffix == ".jsonl":
        return read_jsonl(paths[0])
    if suffix == ".csv":
        return read_csv_rows(paths[0])
    return read_parquet_rows(paths)


def _split_files(folder: Path, split: str) -> list[Path]:
    found = [[folder / f"{split}{ext}"] for ext in FORMATS if (folder / f"{split}{ext}").is_file()]
    shards = sorted(folder.glob(f"{split}-*.parquet"))
    if shards:
        found.append(shards)
    if len(found) > 1:
        raise InputError(f"{folder}: more than one file holds the {split} split "
                         f"({', '.join(p[0].name for p in found)}); keep one")
    return found[0] if found else []


def read_splits(source: str, splits: list[str], key: str, config: str = "", revision: str = "") -> dict[str, list[RawRow]]:
    """The records of each of `splits` (a single file: all its rows under the first split's name)."""
    path = Path(source).expanduser()
    if path.is_dir():
        out = {}
        for split in splits:
            files = _split_files(path, split)
            if not files:
                found = sorted(p.name for p in path.iterdir() if p.suffix in FORMATS)
                raise InputError(f"{key} = {source!r}: no {split} split in this folder (expected {split}.jsonl, "
                                 f"{split}.parquet or {split}.csv; found: {', '.join(found) or 'no data files'})")
            out[split] = read_file(files)
        return out
    if path.is_file():
        if path.suffix not in FORMATS:
            raise InputError(f"{key} = {source!r}: unsupported file type {path.suffix!r}; use "
                             f"{', '.join(FORMATS)}, or a folder of split files")
        return {splits[0]: read_file([path])}
    if "/" not in source or source.count("/") > 1 or Path(source.split("/")[0]).is_dir():
        raise InputError(f"{key} = {source!r}: no such file or folder{did_you_mean(path)}")
    return _read_hub(source, splits, key, config, revision)


def _read_hub(source: str, splits: list[str], key: str, config: str, revision: str) -> dict[str, list[RawRow]]:
    import datasets

    try:
        ds = datasets.load_dataset(source, config or None, revision=revision or None)
    except (OSError, ValueError) as exc:  # ConnectionError, DatasetNotFoundError, bad config name
        offline = " (offline: only the local datasets cache is read)" if _offline() else ""
        raise InputError(f"{key} = {source!r} could not be loaded{offline} "
                         f"({str(exc).splitlines()[0][:160]})") from None
    missing = [s for s in splits if s not in ds]
    if missing:
        raise InputError(f"{key} = {source!r}: no {', '.join(missing)} split; it has {', '.join(ds)}")
    return {s: [RawRow(i, f"{source}:{s}[{i}]", rec) for i, rec in enumerate(ds[s].to_list())] for s in splits}
