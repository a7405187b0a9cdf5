"""Tasks: a task is its data and how it is asked; the prepare stage writes each one's splits.

The built-in `gsm8k` and `arith` keep their files (`data/gsm8k_{train,val,test}.jsonl`,
`data/arith_train.jsonl` and `data/arith_eval.jsonl`, which is arith's validation and test split). Every
other task, the built-in `countdown` and the tasks of the `tasks` section, is written as
`data/tasks/<name>_{train,val,test}.jsonl`. A user task's row is the processed schema
(docs/architecture.md) with its source record under `columns`, which its reward functions receive.

A user task's rows, each one line naming the file and row or the key where it is wrong (exit 2):
- a column named in `fields` that no record has: the columns found are listed;
- a record whose question is not text, or whose answer does not fit the answer type, is malformed;
  more than `max_bad_fraction` of them stops the stage (the first one named);
- `test_fraction` draws the test rows (seeded) where there is no test split; `val_size` train rows
  (seeded) become the validation split, at most half of them.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass
from typing import Any

from pipeline.core.config import BUILTIN_TASKS, Config, TaskConfig
from pipeline.core.errors import InputError
from pipeline.data.countdown import generate_countdown
from pipeline.data.gsm8k import RawRow, _check_text
from pipeline.data.prompts import format_prompt
from pipeline.data.sources import read_splits
from pipeline.data.tokenizer import ANSWER_CLOSE, ANSWER_OPEN

TASK_DIR = "tasks"  # under data/: every task but gsm8k and arith
COUNTDOWN_TEMPLATE = ("Solve the puzzle. Think step by step, then give the expression alone in tags (</answer> "
                      "closes <answer>).\nQuestion: {question}\nAnswer:")
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


@dataclass(frozen=True)
class TaskFiles:
    """A task's prepared files, relative to data/."""

    train: str
    val: str
    test: str


def task_files(name: str) -> TaskFiles:
    if name == "gsm8k":
        return TaskFiles("gsm8k_train.jsonl", "gsm8k_val.jsonl", "gsm8k_test.jsonl")
    if name == "arith":
        return TaskFiles("arith_train.jsonl", "arith_eval.jsonl", "arith_eval.jsonl")
    return TaskFiles(*(f"{TASK_DIR}/{name}_{split}.jsonl" for split in ("train", "val", "test")))


def task_template(cfg: Config, name: str) -> str:
    """The prompt template of a task."""
    if name == "countdown":
        return COUNTDOWN_TEMPLATE
    return cfg.tasks[name].prompt if name in cfg.tasks else cfg.data.prompt_template


def used_tasks(cfg: Config) -> list[str]:
    """The tasks a stage trains on or scores, in that order, then the other tasks of `tasks`."""
    return list(dict.fromkeys([cfg.warmup.task, cfg.grpo.task, *cfg.evaluate.tasks, *cfg.tasks]))


def extra_tasks(cfg: Config) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """`{task: {"train": rows, "val": rows, "test": rows}}` for countdown (where a stage uses it) and every
    task of `tasks`; gsm8k and arith are made by the prepare stage itself."""
    out = {}
    for name in used_tasks(cfg):
        if name == "countdown":
            out[name] = countdown_splits(cfg)
        elif name not in BUILTIN_TASKS:
            out[name] = user_task_splits(cfg, name)
    return out


# --------------------------------------------------------------------------- countdown

def countdown_splits(cfg: Config) -> dict[str, list[dict[str, Any]]]:
    d = cfg.data
    train, held = generate_countdown(d.countdown_train_size, 2 * d.countdown_eval_size, d.seed, d.countdown_numbers)

    def row(p: dict[str, Any], split: str) -> dict[str, Any]:
        return {"id": f"countdown-{split}-{p['id'].rsplit('-', 1)[-1]}", "source": "countdown",
                "question": p["question"], "prompt": format_prompt(p["question"], COUNTDOWN_TEMPLATE),
                "gold": p["target"], "numbers": p["numbers"], "solution": f"{ANSWER_OPEN}{p['solution']}{ANSWER_CLOSE}",
                "level": 0}

    n = d.countdown_eval_size
    return {"train": [row(p, "train") for p in train], "val": [row(p, "val") for p in held[:n]],
            "test": [row(p, "test") for p in held[n:]]}


# --------------------------------------------------------------------------- a user's task

def user_task_splits(cfg: Config, name: str) -> dict[str, list[dict[str, Any]]]:
    t, key = cfg.tasks[name], f"tasks.{name}"
    splits = [t.train_split] + ([t.test_split] if t.test_split else [])
    raw = read_splits(t.source, splits, f"{key}.source", t.config, t.revision)
    for split, records in raw.items():
        _check_columns(records, t, key, split)
    converted = {split: _convert(records, name, t, split, key) for split, records in raw.items()}
    train = converted[t.train_split]
    test = converted.get(t.test_split) if t.test_split in raw else None
    if test is None:
        if t.test_fraction <= 0:
            raise InputError(f"{key}.test_fraction = 0 but {t.source} holds a single split; set a fraction of the "
                             f"rows to hold out as the test split (e.g. {key}.test_fraction: 0.2)")
        train, test = _hold_out(train, round(t.test_fraction * len(train)), f"{name}-test-{cfg.data.seed}",
                                f"{key}.test_fraction = {t.test_fraction}")
    if t.val_size > len(train) // 2:
        raise InputError(f"{key}.val_size = {t.val_size} would leave {len(train) - t.val_size} of {len(train)} train "
                         f"rows to train on; at most half ({len(train) // 2}) may be held out")
    train, val = _hold_out(train, t.val_size, f"{name}-val-{cfg.data.seed}", f"{key}.val_size = {t.val_size}",
                           allow_zero=True)
    return {"train": train, "val": val, "test": test}


def _hold_out(rows: list[dict], n: int, seed: str, what: str, allow_zero: bool = False) -> tuple[list[dict], list[dict]]:
    """(kept, held out): `n` rows drawn with `seed`; both keep the source order."""
    if (n < 1 and not allow_zero) or n >= len(rows):
        raise InputError(f"{what} holds out {n} of {len(rows)} rows; both parts need at least one row")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    held = set(order[:n])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def _needed(t: TaskConfig) -> dict[str, str]:
    """fields key -> column name, for the columns every record must have."""
    needed = {"question": t.fields.question, "answer": t.fields.answer}
    needed.update({k: getattr(t.fields, k) for k in ("id", "choices", "numbers") if getattr(t.fields, k)})
    return needed


def _check_columns(records: list[RawRow], t: TaskConfig, key: str, split: str) -> None:
    """InputError when a column named in `fields` is in no record of the split (a misspelt name)."""
    found = list(dict.fromkeys(c for r in records if isinstance(r.data, dict) for c in r.data))
    if not records:
        raise InputError(f"{key}.source = {t.source!r}: the {split} split has no rows")
    for field_name, column in _needed(t).items():
        if column not in found:
            where = records[0].location.rsplit(":", 1)[0]
            raise InputError(f"{key}.fields.{field_name} = {column!r}: no such column in {where}; columns found: "
                             f"{', '.join(map(str, found)) or 'none'}")


def _convert(records: list[RawRow], name: str, t: TaskConfig, split: str, key: str) -> list[dict[str, Any]]:
    rows, bad = [], []
    for raw in records:
        try:
            rows.append(task_row(raw, name, t, split))
        except ValueError as exc:
            bad.append((raw.location, str(exc)))
    if len(bad) > t.max_bad_fraction * len(records):
        loc, why = bad[0]
        raise InputError(f"{loc}: {why} ({len(bad)} of {len(records)} {split} rows are malformed; "
                         f"{key}.max_bad_fraction = {t.max_bad_fraction})")
    return rows


def task_row(raw: RawRow, name: str, t: TaskConfig, split: str) -> dict[str, Any]:
    """One processed row of a user task; ValueError says what is malformed."""
    if raw.error:
        raise ValueError(raw.error)
    data, f = raw.data, t.fields
    if not isinstance(data, dict):
        raise ValueError(f"expected an object with columns, got {type(data).__name__}")
    for column in _needed(t).values():
        if data.get(column) is None:
            raise ValueError(f"column {column!r} is missing or null")
    question = data[f.question]
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"column {f.question!r} (the question) must be non-empty text, got {_show(question)}")
    _check_text(f.question, question)
    row: dict[str, Any] = {}
    gold = answer_gold(t.answer, data[f.answer], f.answer)
    if f.choices:
        options = data[f.choices]
        if not isinstance(options, list) or not 2 <= len(options) <= 26:
            raise ValueError(f"column {f.choices!r} (the choices) must be a list of 2 to 26 options")
        question = question.strip() + "\n" + "\n".join(f"{chr(65 + i)}. {o}" for i, o in enumerate(options))
        if gold not in [chr(65 + i) for i in range(len(options))]:
            raise ValueError(f"answer {gold!r} is not one of the {len(options)} choices' letters")
    if t.answer == "expression":
        nums = data[f.numbers]
        if not isinstance(nums, list) or not nums or not all(type(n) is int and n >= 0 for n in nums):
            raise ValueError(f"column {f.numbers!r} (the numbers) must be a list of non-negative integers")
        row["numbers"] = nums
    ident = str(data[f.id]) if f.id else f"{name}-{split}-{raw.index:05d}"
    return {"id": ident, "source": name, "question": question.strip(), "prompt": format_prompt(question, t.prompt),
            "gold": gold, "solution": f"{ANSWER_OPEN}{gold}{ANSWER_CLOSE}", "level": 0, **row,
            "columns": {str(k): _jsonable(v) for k, v in data.items()}}


def answer_gold(answer: str, value: Any, column: str) -> Any:
    """The gold of one record's answer under the answer type; ValueError where it does not fit."""
    if answer in ("number", "expression"):
        gold = _number(value)
        if gold is None:
            raise ValueError(f"column {column!r} = {_show(value)} is not a number (answer: {answer}; a number or a "
                             "text ending in one, such as '#### 42')")
        if answer == "expression" and gold != int(gold):
            raise ValueError(f"column {column!r} = {_show(value)}: an expression's target is an integer")
        return int(gold) if gold == int(gold) and abs(gold) < 2**53 else gold
    if answer == "choice":
        letter = value.strip().strip("().").upper() if isinstance(value, str) else ""
        if len(letter) != 1 or not "A" <= letter <= "Z":
            raise ValueError(f"column {column!r} = {_show(value)} is not a choice letter (A, B, ...)")
        return letter
    if answer == "text":
        if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not str(value).strip():
            raise ValueError(f"column {column!r} = {_show(value)} is not a non-empty text answer")
        return str(value).strip()
    json.dumps(value, allow_nan=False)  # a user checker's gold: any JSON value
    return value


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, str):
        text = value.rsplit("####", 1)[-1].strip()
        if _NUMBER_RE.fullmatch(text):
            return float(text.replace(",", ""))
    return None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _jsonable(value: Any) -> Any:
    """A source value as JSON holds it (a Parquet date or bytes as its text)."""
    try:
        json.dumps(value, allow_nan=False)
        return value
    except (TypeError, ValueError):
        return str(value)
