"""The pipeline's file formats: atomic writes (a temporary file beside the target, fsync, rename:
a crash or an exception mid-write leaves the previous file intact and no partial file behind), the
line reader under the one JSONL reader of prepared data (`text_lines`: bounded line size, strict
UTF-8; `pipeline.data.schema.read_rows` checks each row) and the one file hash (`sha256`).

A stage's outputs as one unit (all new or all old, never a mix):
- `replaced_dir(target)`: the stage writes a whole folder (prepare's `data/`) into a temporary
  folder beside it, which is then swapped in with one atomic `renameat2(RENAME_EXCHANGE)` (two
  renames where the kernel lacks it: a kill between them leaves no folder, never a mixed one).
  Files in the old folder that the stage does not write are carried over as hard links.
  A target that is a symlink (data on a bigger volume) is kept: the swap happens at the folder it
  points to, beside it on its own filesystem (`real_target`).
- `staged_outputs(name)`: files spread over several folders (evaluate's reports, plots, metrics)
  are written under `.staging-<name>/`, then a journal is written and the files renamed into
  place; a run killed after the journal is rolled forward by the next `recover_outputs(name)`,
  one killed before it leaves the old files untouched.
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import errno
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from pipeline.core.errors import InputError, StorageError


def sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


MAX_LINE_BYTES = 64 * 1024  # a prepared row is a few kB; longer lines are not rows this pipeline wrote


def did_you_mean(path: str | Path, root: str | Path = ".") -> str:
    """``; did you mean 'datasets/gsm8k'?`` when a missing path's folder (under `root`, for a relative
    path) holds an entry whose name is close to the missing one's; else empty."""
    import difflib

    path = Path(path)
    folder = Path(root) / path.parent
    if not folder.is_dir():
        return ""
    match = difflib.get_close_matches(path.name, [p.name for p in folder.iterdir()], n=1, cutoff=0.6)
    return f"; did you mean {str(path.parent / match[0])!r}?" if match else ""


def text_lines(path: str | Path, max_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line, read with a bounded buffer (memory stays small whatever the
    file holds); a line over `max_bytes`, or one that is not UTF-8, raises InputError naming it. A
    UTF-8 byte-order mark at the start is dropped."""
    path = Path(path)
    with path.open("rb") as f:
        lineno = 0
        while line := f.readline(max_bytes + 1):
            lineno += 1
            if len(line) > max_bytes and not line.endswith(b"\n"):
                raise InputError(f"{path}:{lineno}: a row of more than {max_bytes} bytes; GSM8K rows "
                                 "are under 2 kB (is this the right file?)")
            if lineno == 1 and line.startswith(codecs.BOM_UTF8):
                line = line[len(codecs.BOM_UTF8):]
            try:
                yield lineno, line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(f"{path}:{lineno}: not UTF-8 text (byte {line[exc.start]:#04x} at column "
                                 f"{exc.start + 1}); convert the file first, e.g. iconv -f latin1 -t utf-8") from None


def json_problem(exc: Exception) -> str:
    """What `json.loads` refused, in a few words: the decoder's message, the first clause of another
    ValueError's (Python refuses integers of over 4,300 digits), or the nesting."""
    if isinstance(exc, json.JSONDecodeError):
        return exc.msg
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc).split(";")[0].split(":")[0]


STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # disk full, quota, file size limit (ulimit -f)


def storage_errno(exc: BaseException) -> int | None:
    """The disk-full / quota / file-size-limit errno behind `exc`, or None. Rust-backed writers
    (safetensors, tokenizers) raise their own types with "(os error N)" in the message."""
    if isinstance(exc, OSError):
        return exc.errno if exc.errno in STORAGE_ERRNOS else None
    text = str(exc)
    return next((code for code in STORAGE_ERRNOS if f"(os error {code})" in text), None)


def raise_if_storage(exc: BaseException, path: str | Path) -> None:
    """Re-raise a disk-full / quota / file-size-limit error as one line naming `path`."""
    code = storage_errno(exc)
    if code is not None:
        raise StorageError(f"{path}: cannot write ({os.strerror(code)}); the previous version, if any, "
                           "is left intact; free space or raise the limit and re-run") from None


@contextlib.contextmanager
def storage_errors(path: str | Path) -> Iterator[None]:
    """Turn a storage error raised inside the block into a :class:`StorageError` naming `path`."""
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:
        raise_if_storage(exc, path)
        raise


def ensure_dir(folder: str | Path) -> Path:
    """`folder` (created with its parents); an InputError if it or a parent is a regular file."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in [folder, *folder.parents] if p.exists() and not p.is_dir()), folder)
        raise InputError(f"{blocker}: is a file where a folder is needed for {folder}/; move it away") from None
    return folder

def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> Path:
    """Call `write(f)` on a temporary file beside `path`, fsync, then rename over `path`.

    If `write` raises, the temporary file is removed and any previous `path` is left untouched.
    """
    path = Path(path)
    ensure_dir(path.parent)
    if path.is_dir():
        raise InputError(f"{path}: is a folder where a file is written; move it away")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise_if_storage(exc, path)
        raise
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


# --------------------------------------------------------------------------- whole-output swaps

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the kernel or filesystem cannot."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _link_tree(src: Path, dst: Path) -> None:
    """`src` recreated at `dst` with hard links (symlinks copied as links): no data copied."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=os.link)
    else:
        os.link(src, dst)


def remove_stale(parent: Path, prefix: str) -> None:
    """Remove the folders `parent/{prefix}{pid}-*` whose process is gone: the temporary folders of
    killed runs (a write names its temporary folder after its pid)."""
    for p in parent.glob(f"{prefix}*"):
        pid = p.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                shutil.rmtree(p, ignore_errors=True)
            except PermissionError:
                pass


def real_target(path: str | Path) -> Path:
    """The folder a whole-folder write replaces: `path` itself, or, where `path` is a symlink, the
    folder it points to (followed to the end, existing or not), so the link stays a link and the
    temporary folder lies on the target's filesystem (a rename across filesystems fails)."""
    path = Path(path)
    return path.resolve() if path.is_symlink() else path


@contextlib.contextmanager
def replaced_dir(target: str | Path) -> Iterator[Path]:
    """Yield a temporary folder beside `target` (beside the folder it links to, for a symlink); on
    success it becomes `target` in one swap."""
    target = real_target(target)
    if target.exists() and not target.is_dir():
        raise InputError(f"{target}: is a file where the stage writes the folder {target}/; move it away")
    parent = ensure_dir(target.absolute().parent)
    prefix = f".{target.name}.tmp-"
    remove_stale(parent, prefix)
    tmp = parent / f"{prefix}{os.getpid()}-{os.urandom(3).hex()}"
    tmp.mkdir()
    try:
        with storage_errors(target):
            yield tmp
            _swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_in(tmp: Path, target: Path) -> None:
    if not target.exists():
        os.rename(tmp, target)
        return
    for entry in target.iterdir():  # what the stage does not write stays
        if not (tmp / entry.name).exists() and not entry.name.startswith(f".{target.name}.tmp-"):
            _link_tree(entry, tmp / entry.name)
    _fsync_dir(tmp)
    if _exchange(tmp, target):
        shutil.rmtree(tmp)  # now the old folder
        return
    old = tmp.with_name(tmp.name + "-old")
    os.rename(target, old)
    os.rename(tmp, target)
    shutil.rmtree(old)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _staging(name: str) -> Path:
    return Path(f".staging-{name}")


def recover_outputs(name: str) -> None:
    """Finish a publish of `staged_outputs(name)` that a kill interrupted, or drop an unfinished staging."""
    staging = _staging(name)
    journal = staging / "journal.json"
    if journal.is_file():
        _roll_forward(journal)
    shutil.rmtree(staging, ignore_errors=True)


def _roll_forward(journal: Path) -> None:
    for src, dst in json.loads(journal.read_text()):
        if Path(src).exists():
            ensure_dir(Path(dst).parent)
            os.replace(src, dst)
    journal.unlink()


@contextlib.contextmanager
def staged_outputs(name: str) -> Iterator[Callable[[str | Path], Path]]:
    """Yield `stage(path) -> temporary path`; files written there appear at their `path`s together."""
    recover_outputs(name)
    staging = ensure_dir(_staging(name))
    moves: dict[Path, Path] = {}

    def stage(path: str | Path) -> Path:
        staged = staging / "files" / str(len(moves)) / Path(path).name
        ensure_dir(staged.parent)
        moves[staged] = Path(path)
        return staged

    try:
        with storage_errors(staging):
            yield stage
        for dst in moves.values():  # refuse before anything moves: a file where a folder goes
            ensure_dir(dst.parent)
        write_json_atomic(staging / "journal.json", [[str(s), str(d)] for s, d in moves.items() if s.exists()])
        _roll_forward(staging / "journal.json")
    finally:
        if not (staging / "journal.json").exists():  # a journal left by an error is finished by recover
            shutil.rmtree(staging, ignore_errors=True)
