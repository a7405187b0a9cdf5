"""Bad GSM8K files and bad prepared data: each gives one line naming file:line, nothing is half-written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from pipeline.core import files
from pipeline.core.config_loading import load_config
from pipeline.core.errors import InputError
from pipeline.data import gsm8k as gs
from pipeline.data.schema import read_rows
from pipeline.stages.prepare import run_prepare
from tests.conftest import GOOD, GOOD_TEST, TEMPLATE, write_jsonl

REPO = Path(__file__).resolve().parents[1]


def _source(tmp_path, train=None, test=None) -> Path:
    src = tmp_path / "src"
    write_jsonl(src / "train.jsonl", train if train is not None else GOOD * 5)
    write_jsonl(src / "test.jsonl", test if test is not None else GOOD_TEST)
    return src


def _cfg(*extra):
    return load_config(REPO / "configs" / "smoke.yaml", ["data.gsm8k_source=src", "data.val_size=2", *extra])


# --------------------------------------------------------------------------- source files

def test_empty_parquet_with_the_right_schema_is_an_empty_split(tmp_path):
    (tmp_path / "pq").mkdir()
    empty = pd.DataFrame({"question": pd.Series([], dtype=str), "answer": pd.Series([], dtype=str)})
    empty.to_parquet(tmp_path / "pq" / "train.parquet")
    pd.DataFrame(GOOD).to_parquet(tmp_path / "pq" / "test.parquet")
    raw = gs.load_raw(str(tmp_path / "pq"))
    assert raw["train"] == [] and len(raw["test"]) == len(GOOD)
    with pytest.raises(InputError, match="the train split has no rows"):
        gs.validate_split(raw["train"], "train", TEMPLATE, 0.0, "pq")


def test_a_garbage_parquet_file_is_one_line(tmp_path):
    (tmp_path / "pq").mkdir()
    (tmp_path / "pq" / "train.parquet").write_bytes(b"PAR1" + os.urandom(200))
    pd.DataFrame(GOOD).to_parquet(tmp_path / "pq" / "test.parquet")
    with pytest.raises(InputError, match="train.parquet: not a readable Parquet file") as info:
        gs.load_raw(str(tmp_path / "pq"))
    assert "\n" not in str(info.value)


def test_a_lone_surrogate_is_a_rejected_row_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad = json.dumps({"question": "How many \ud800 apples?", "answer": "#### 3"})  # JSON escape \ud800
    _source(tmp_path, train=[*GOOD * 25, bad])
    out = run_prepare(_cfg())
    assert out["rejected"] == 1
    stats = json.loads(Path("data/stats.json").read_text())
    assert "lone surrogate (U+D800)" in stats["rejected"]["rows"][0]["reason"]
    assert stats["rejected"]["rows"][0]["location"].endswith("train.jsonl:101")


def test_a_50_mb_line_is_refused_with_bounded_memory(tmp_path):
    src = _source(tmp_path)
    with open(src / "train.jsonl", "a") as f:
        f.write(json.dumps({"question": "x" * 50_000_000, "answer": "#### 1"}) + "\n")
    code = ("import sys\nfrom pipeline.data.gsm8k import load_raw\nfrom pipeline.core.errors import InputError\n"
            f"try:\n    load_raw({str(src)!r})\nexcept InputError as e:\n    print(e)\n"
            # this process's own peak (VmHWM): ru_maxrss would also count the parent's pages, which
            # Linux carries into a vforked child's figure (over 1 GB late in a full test run)
            "print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    message, rss_kb = res.stdout.strip().splitlines()
    assert "train.jsonl:21: a row of more than 65536 bytes" in message
    assert int(rss_kb) < 1_000_000  # the 50 MB line is never held (it was 11 GB)


def test_a_file_over_the_size_limit_is_refused(tmp_path, monkeypatch):
    src = _source(tmp_path)
    monkeypatch.setattr(gs, "MAX_FILE_BYTES", 100)
    with pytest.raises(InputError, match=r"train.jsonl: \d+ bytes is more than a GSM8K split can be"):
        gs.load_raw(str(src))


def test_a_latin1_file_is_refused_naming_the_line(tmp_path):
    src = _source(tmp_path)
    text = (src / "train.jsonl").read_text().replace("Natalia", "Nat\u00e9lia")
    (src / "train.jsonl").write_bytes(text.encode("latin-1"))
    with pytest.raises(InputError, match=r"train.jsonl:1: not UTF-8 text \(byte 0xe9 at column \d+\).*iconv"):
        gs.load_raw(str(src))


def test_a_utf8_bom_keeps_the_first_row(tmp_path):
    src = _source(tmp_path)
    (src / "train.jsonl").write_bytes(b"\xef\xbb\xbf" + (src / "train.jsonl").read_bytes())
    raw = gs.load_raw(str(src))
    rows, bad = gs.validate_split(raw["train"], "train", TEMPLATE, 0.0, "src")
    assert not bad and len(rows) == len(GOOD) * 5 and rows[0]["gold"] == 72.0


def test_a_very_long_question_in_parquet_is_a_rejected_row(tmp_path):
    (tmp_path / "pq").mkdir()
    long = {"question": "x" * (gs.MAX_TEXT_CHARS + 1), "answer": "#### 1"}
    pd.DataFrame([*GOOD, long]).to_parquet(tmp_path / "pq" / "train.parquet")
    pd.DataFrame(GOOD).to_parquet(tmp_path / "pq" / "test.parquet")
    raw = gs.load_raw(str(tmp_path / "pq"))
    rows, bad = gs.validate_split(raw["train"], "train", TEMPLATE, 0.5, "pq")
    assert len(rows) == len(GOOD) and "'question' is" in bad[0].reason


# --------------------------------------------------------------------------- prepared rows

ROW = {"id": "gsm8k-test-00000", "source": "gsm8k", "question": "q", "prompt": "Q: q\nA:", "gold": 3.0,
       "solution": "<answer>3</answer>", "level": 0}


@pytest.mark.parametrize("change,pattern", [
    ({"gold": None}, r"'gold' = None is not a finite number"),
    ({"gold": "72"}, r"'gold' = '72' is not a finite number"),
    ({"gold": float("nan")}, r"'gold' = nan is not a finite number"),
    ({"gold": True}, r"'gold' = True is not a finite number"),
    ({"source": None}, r"'source' = None is not a task name"),
    ({"source": "mine", "gold": None}, r"'gold' = None is not an answer"),
    ({"prompt": 5}, r"missing or non-text 'prompt'"),
    ("drop-gold", r"missing 'gold'"),
])
def test_prepared_rows_are_checked_by_every_reader(tmp_path, change, pattern):
    from pipeline.stages.evaluate import load_rows

    row = dict(ROW)
    if change == "drop-gold":
        del row["gold"]
    else:
        row.update(change)
    path = tmp_path / "gsm8k_test.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + json.dumps(row) + "\n")
    for reader in (read_rows, load_rows):
        with pytest.raises(InputError, match=rf"gsm8k_test.jsonl:2: {pattern}") as info:
            reader(path)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("line,problem", [
    ('{"gold": ' + "7" * 5000 + "}", r"Exceeds the limit \(4300 digits\) for integer string conversion"),
    ("[" * 5000 + "]" * 5000, "nested too deeply"),
    ('{"gold": 1', "Expecting ',' delimiter"),
])
def test_a_prepared_line_json_refuses_is_one_line_for_every_reader(tmp_path, line, problem):
    """Python's json refuses integers of over 4,300 digits with a plain ValueError (not a
    JSONDecodeError), which once escaped as a traceback."""
    from pipeline.stages.evaluate import load_rows

    path = tmp_path / "gsm8k_test.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + line + "\n")
    for reader in (read_rows, load_rows):
        with pytest.raises(InputError, match=rf"gsm8k_test.jsonl:2: invalid JSON \({problem}[^;]*\); re-run") as info:
            reader(path)
        assert "\n" not in str(info.value)


@pytest.mark.slow
def test_cli_on_a_prepared_row_with_a_string_gold_is_one_line_exit_2(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("gsm8k_test", "arith_eval"):
        (data / f"{name}.jsonl").write_text(json.dumps({**ROW, "gold": "three"}) + "\n")
    res = subprocess.run([sys.executable, "-m", "pipeline", "evaluate", "--params", str(REPO / "configs" / "smoke.yaml")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: data/gsm8k_test.jsonl:1: 'gold' = 'three'")


# --------------------------------------------------------------------------- output folders

def test_an_output_folder_that_is_a_file_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _source(tmp_path)
    Path("data").write_text("not a folder")
    with pytest.raises(InputError, match="data: is a file where the stage writes the folder data/"):
        run_prepare(_cfg())
    assert Path("data").read_text() == "not a folder"
    with pytest.raises(InputError, match=r"^metrics: is a file where a folder is needed"):
        Path("metrics").write_text("x")
        files.write_json_atomic("metrics/eval.json", {})


def test_prepare_replaces_data_as_one_unit_and_keeps_foreign_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _source(tmp_path)
    run_prepare(_cfg())
    (Path("data") / "notes.txt").write_text("mine")
    (Path("data") / "extra").mkdir()
    (Path("data") / "extra" / "a.txt").write_text("a")
    before = {p.name: p.read_bytes() for p in Path("data").glob("*.json*")}
    with pytest.raises(InputError):  # a failing re-run leaves every old file as it was
        run_prepare(_cfg("data.val_size=1000"))
    assert {p.name: p.read_bytes() for p in Path("data").glob("*.json*")} == before
    run_prepare(_cfg("data.seed=1"))
    assert (Path("data") / "notes.txt").read_text() == "mine" and (Path("data") / "extra" / "a.txt").read_text() == "a"
    assert (Path("data") / "gsm8k_val.jsonl").read_bytes() != before["gsm8k_val.jsonl"]
    assert not list(Path(".").glob(".data.tmp-*"))


def test_replaced_dir_on_error_changes_nothing(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "a").write_text("old")
    with pytest.raises(RuntimeError):
        with files.replaced_dir(target) as tmp:
            (tmp / "a").write_text("new")
            raise RuntimeError("killed")
    assert (target / "a").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_stale_temporary_folder_of_a_dead_run_is_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".out.tmp-{dead.stdout.strip()}-abcdef"
    stale.mkdir()
    with files.replaced_dir(tmp_path / "out") as tmp:
        (tmp / "a").write_text("x")
    assert not stale.exists() and (tmp_path / "out" / "a").read_text() == "x"


def test_staged_outputs_appear_together_and_a_journal_is_rolled_forward(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with files.staged_outputs("evaluate") as stage:
        files.write_json_atomic(stage("metrics/eval.json"), {"a": 1})
        files.write_bytes_atomic(stage("reports/p.csv"), b"x\n")
        assert not Path("metrics/eval.json").exists()  # nothing in place before the end
    assert json.loads(Path("metrics/eval.json").read_text()) == {"a": 1} and Path("reports/p.csv").exists()
    with pytest.raises(RuntimeError), files.staged_outputs("evaluate") as stage:
        files.write_json_atomic(stage("metrics/eval.json"), {"a": 2})
        raise RuntimeError("fails before the journal")
    assert json.loads(Path("metrics/eval.json").read_text()) == {"a": 1} and not Path(".staging-evaluate").exists()
    # a run killed after writing its journal, before the renames: the next recover finishes it
    staged = Path(".staging-evaluate/files/0/eval.json")
    staged.parent.mkdir(parents=True)
    staged.write_text('{"a": 3}')
    Path(".staging-evaluate/journal.json").write_text(json.dumps([[str(staged), "metrics/eval.json"]]))
    files.recover_outputs("evaluate")
    assert json.loads(Path("metrics/eval.json").read_text()) == {"a": 3} and not Path(".staging-evaluate").exists()


def _other_filesystem(tmp_path: Path) -> Path:
    """A folder on another filesystem than tmp_path (tmpfs /dev/shm), where there is one."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev or not os.access(shm, os.W_OK):
        pytest.skip("no second filesystem here")
    folder = shm / f"grpo-test-{os.getpid()}-{tmp_path.name}"
    folder.mkdir()
    return folder


@pytest.mark.parametrize("where", ["same filesystem", "another filesystem"])
def test_a_symlinked_data_folder_stays_a_link_and_is_replaced_where_it_points(tmp_path, monkeypatch, where):
    """Data on a bigger volume: `data` -> elsewhere. prepare writes there (twice: a first run and a
    re-run that swaps), the link stays, and nothing is left behind on either side."""
    monkeypatch.chdir(tmp_path)
    _source(tmp_path)
    volume = _other_filesystem(tmp_path) if where == "another filesystem" else tmp_path / "volume"
    volume.mkdir(exist_ok=True)
    try:
        Path("data").symlink_to(volume / "data")  # dangling until the first run
        run_prepare(_cfg())
        (Path("data") / "notes.txt").write_text("mine")
        first = (volume / "data" / "gsm8k_val.jsonl").read_bytes()
        run_prepare(_cfg("data.seed=1"))
        assert Path("data").is_symlink() and os.readlink("data") == str(volume / "data")
        assert (volume / "data" / "gsm8k_val.jsonl").read_bytes() != first
        assert (volume / "data" / "notes.txt").read_text() == "mine"
        assert sorted(p.name for p in volume.iterdir()) == ["data"]  # no temporary folder left
        assert not list(Path(".").glob(".data.tmp-*"))
    finally:
        if where == "another filesystem":
            import shutil

            shutil.rmtree(volume, ignore_errors=True)


def test_a_symlinked_checkpoint_folder_stays_a_link(tmp_path, gpt_policy):
    from pipeline.train.checkpoint import load_policy, save_policy

    volume = _other_filesystem(tmp_path)
    try:
        (tmp_path / "checkpoints").mkdir()
        link = tmp_path / "checkpoints" / "sft"
        link.symlink_to(volume / "sft")
        for _ in range(2):  # a first save, then one that replaces it
            save_policy(link, gpt_policy)
        assert link.is_symlink() and (volume / "sft" / "manifest.json").is_file()
        assert sorted(p.name for p in volume.iterdir()) == ["sft"]
        assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["sft"]
        load_policy(link, device="cpu")
    finally:
        import shutil

        shutil.rmtree(volume, ignore_errors=True)
