"""The pipeline's file formats: atomic writes (a temporary file beside the target, fsync, rename:
a crash or an exception mid-write leaves the previous file intact and no partial file behind), the
one JSONL reader of prepared data (`read_rows`) and the one file hash (`sha256`)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from pipeline.errors import InputError


def sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_rows(path: str | Path, limit: int = 0) -> list[dict[str, Any]]:
    """The first `limit` rows (0 = all) of a prepared JSONL file, in file order; blank lines skipped.

    A missing file or a line that is not a JSON object raises :class:`InputError` naming the file
    (and line) and the stage that writes it.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: not found (run the 'prepare' stage first)")
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{lineno}: invalid JSON ({exc.msg}); re-run the 'prepare' stage") from None
            if not isinstance(row, dict):
                raise InputError(f"{path}:{lineno}: expected a JSON object per line; re-run the 'prepare' stage")
            rows.append(row)
            if limit and len(rows) >= limit:
                break
    return rows


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> Path:
    """Call `write(f)` on a temporary file beside `path`, fsync, then rename over `path`.

    If `write` raises, the temporary file is removed and any previous `path` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """Indented JSON with a trailing newline; keys keep insertion order (stable diffs for DVC)."""
    text = json.dumps(obj, indent=2, allow_nan=False) + "\n"  # serialise first: a bad value writes nothing
    return write_bytes_atomic(path, text.encode())


def write_csv_atomic(path: str | Path, df) -> Path:
    text = df.to_csv(index=False, lineterminator="\n")
    return write_bytes_atomic(path, text.encode())


def write_series_csv(path: str | Path, rows: Iterable[Mapping[str, Any]], columns: Sequence[str]) -> Path:
    """Atomically write a metric series as CSV for `dvc plots`: a header of `columns`, one line per
    row, floats with 6 significant digits, empty cells for missing (None) values."""
    def cell(v: Any) -> str:
        return "" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v)

    lines = [",".join(columns)] + [",".join(cell(r.get(c)) for c in columns) for r in rows]
    return write_bytes_atomic(path, ("\n".join(lines) + "\n").encode())
