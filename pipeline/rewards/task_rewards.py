"""A task's reward: how its answers are checked, and the weighted parts the reward sums.

Answer types (``tasks.<name>.answer``; the built-in tasks gsm8k and arith are `number`, countdown is
`expression`). A completion's answer is the content of its last ``<answer>...</answer>`` block, except
for `number`, read by the grammar of :mod:`pipeline.rewards.parsing` (which also reads an answer given
without the tags):
- `number`: the value equals the gold exactly (:func:`pipeline.rewards.verifiers.answers_match`);
- `text`: equal after case folding, collapsing spaces and dropping spaces and ``.,;:!?"'`` at the ends;
- `choice`: one letter (``B``, ``(B)``, ``B.``, ``B)``) equal to the gold letter;
- `expression`: a countdown expression that uses each given number once and reaches the target
  (:mod:`pipeline.rewards.countdown`: parsed, never evaluated as Python);
- ``module:function``: the user's ``fn(answer_text, gold) -> bool`` (the block's content, or "" where
  there is none).
Well-formed: exactly one ``<answer>`` and one ``</answer>``, in that order, around an answer the type
can read (for `number`, exactly one number).

Reward parts (``tasks.<name>.rewards`` with ``reward_weights``; built-in tasks: ``[correct, format]``
weighted ``[1.0, 0.2]``, the reference chapter's +1.0 and +0.2): ``correct`` (1 or 0), ``format`` (1 or
0), ``length`` (minus the completion's characters / 1000, at least -1), or ``module:function``, a user's
function with TRL's ``reward_funcs`` signature: ``fn(prompts, completions, **columns)``, each column of
the task's rows as a list aligned with the completions, returning one float or None (no opinion,
counted 0 in the sum) per completion; a TRL reward function works as is. The reward is the weighted
sum, each part is kept for logging (``reward/<name>``).

Naming ``module:function`` in a params file names code that runs in every stage that scores, as a
Hydra ``_target_`` does: it is imported, never evaluated from text. Modules of the standard library
and builtins are refused (``os:system`` is a slip, not a reward). Each user function is checked at
stage start, on the task's first training row, before any work: it imports, it is callable, and it
returns a list of one finite number or None per completion; every later call is checked the same way,
and an exception is one line naming the function (exit 2).
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.core.config import BUILTIN_TASKS, Config, TaskConfig
from pipeline.core.errors import InputError
from pipeline.rewards.countdown import check_countdown, parse_expression
from pipeline.rewards.parsing import ANSWER_CLOSE, ANSWER_OPEN, answer_block, extract_answer, extract_exact
from pipeline.rewards.verifiers import answers_match, has_well_formed_answer

BUILTIN_PARTS = {"gsm8k": ("number", ["correct", "format"], [1.0, 0.2]),
                 "arith": ("number", ["correct", "format"], [1.0, 0.2]),
                 "countdown": ("expression", ["correct", "format"], [1.0, 0.2])}
assert tuple(BUILTIN_PARTS) == BUILTIN_TASKS
LENGTH_SCALE = 1000  # characters: `length` is -1 at this length and beyond
_ENDS = " \t\n.,;:!?\"'"
_CHOICE_RE = re.compile(r"\(?([A-Za-z])[).:]?")


# --------------------------------------------------------------------------- answers

def normalize_text(text: str) -> str:
    """`text` compared as a `text` answer: case-folded, inner spaces collapsed, punctuation at the ends dropped."""
    return " ".join(str(text).casefold().split()).strip(_ENDS)


def choice_letter(text: str) -> str | None:
    """The one letter of a choice answer (`B`, `(B)`, `B.`, `B)`), upper-case; None otherwise."""
    m = _CHOICE_RE.fullmatch(text.strip()) if isinstance(text, str) else None
    return m.group(1).upper() if m else None


def _one_block(completion: str) -> str | None:
    """The content of the completion's only `<answer>` block (None: none, or more than one)."""
    if completion.count(ANSWER_OPEN) != 1 or completion.count(ANSWER_CLOSE) != 1:
        return None
    return answer_block(completion)


@dataclass(frozen=True)
class Checker:
    """How one answer type reads, checks and recognises a well-formed answer."""

    answer: str  # number, text, choice, expression or module:function
    user: Callable[[str, Any], Any] | None = None

    def parsed(self, completion: str) -> Any:
        """The answer a completion gives, as compared (a float for `number`, text otherwise; None: none)."""
        if self.answer == "number":
            return extract_answer(completion)
        block = answer_block(completion)
        if block is None:
            return None
        if self.answer == "text":
            return normalize_text(block)
        if self.answer == "choice":
            return choice_letter(block)
        return " ".join(block.split())

    def correct(self, completion: str, row: dict[str, Any]) -> bool:
        gold = row["gold"]
        if self.answer == "number":
            return bool(answers_match(extract_exact(completion), gold))
        block = answer_block(completion)
        if self.user is not None:
            return self._user_check(block or "", gold)
        if block is None:
            return False
        if self.answer == "text":
            return normalize_text(block) == normalize_text(gold)
        if self.answer == "choice":
            return choice_letter(block) == str(gold).upper()
        return check_countdown(block, int(gold), list(row["numbers"]))

    def well_formed(self, completion: str) -> bool:
        if self.answer == "number":
            return has_well_formed_answer(completion)
        block = _one_block(completion)
        if block is None or not block.strip():
            return False
        if self.answer == "choice":
            return choice_letter(block) is not None
        if self.answer == "expression":
            return parse_expression(block.strip().split("=")[0]) is not None
        return True

    def _user_check(self, text: str, gold: Any) -> bool:
        try:
            return bool(self.user(text, gold))
        except Exception as exc:
            raise InputError(f"answer checker {self.answer} raised {_exc(exc)} (on answer {text[:80]!r}, gold "
                             f"{gold!r})") from None


# --------------------------------------------------------------------------- user functions

def _exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def import_function(spec: str, key: str) -> Callable[..., Any]:
    """The function `module:function` names (config key `key` in messages): imported by name, never
    evaluated; modules of the standard library and builtins are refused."""
    module_name, _, attr = spec.partition(":")
    top = module_name.split(".")[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names or top == "builtins":
        raise InputError(f"{key} = {spec!r}: {top} is part of Python's standard library; a reward or checker "
                         "names a function of your own code (e.g. mypkg.rewards:brevity)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise InputError(f"{key} = {spec!r}: no module {exc.name!r} to import (run from the folder that holds "
                         f"{top}/, or install it; sys.path starts with {sys.path[0] or '.'!r})") from None
    except Exception as exc:  # the user's module failing at import: one line, not a traceback
        raise InputError(f"{key} = {spec!r}: importing {module_name} failed ({_exc(exc)})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise InputError(f"{key} = {spec!r}: {module_name} has no {attr!r}")
    if not callable(fn) or isinstance(fn, type):
        raise InputError(f"{key} = {spec!r}: {module_name}.{attr} is a {type(fn).__name__}, not a function")
    return fn


def _check_scores(values: Any, n: int, where: str) -> list[float | None]:
    """A user reward's return value as n floats or None; InputError naming `where` otherwise."""
    if not isinstance(values, (list, tuple)):
        raise InputError(f"{where} returned {type(values).__name__} {str(values)[:60]!r}; a reward function returns "
                         f"a list of one float (or None) per completion")
    if len(values) != n:
        raise InputError(f"{where} returned {len(values)} values for {n} completions; it returns one per completion")
    out: list[float | None] = []
    for v in values:
        if v is None:
            out.append(None)
            continue
        x = float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else math.nan
        if not math.isfinite(x):
            raise InputError(f"{where} returned {str(v)[:60]!r}; each value is a finite number or None")
        out.append(x)
    return out


# --------------------------------------------------------------------------- a task's reward

@dataclass
class TaskRewards:
    """The checker and weighted reward parts of one task."""

    task: str
    checker: Checker
    names: list[str]
    weights: list[float]
    user: dict[str, Callable[..., Any]] = field(default_factory=dict)  # name -> function, for user parts

    def parts(self, prompts: Sequence[str], completions: Sequence[str],
              rows: Sequence[dict[str, Any]]) -> dict[str, list[float | None]]:
        """Each part's value per completion (completion i answers rows[i] after prompts[i])."""
        out: dict[str, list[float | None]] = {}
        for name in self.names:
            if name == "correct":
                out[name] = [float(self.checker.correct(c, r)) for c, r in zip(completions, rows)]
            elif name == "format":
                out[name] = [float(self.checker.well_formed(c)) for c in completions]
            elif name == "length":
                out[name] = [-min(1.0, len(c) / LENGTH_SCALE) for c in completions]
            else:
                out[name] = self._call(name, prompts, completions, rows)
        return out

    def _call(self, name: str, prompts, completions, rows) -> list[float | None]:
        where = f"tasks.{self.task}.rewards: {name}"
        columns = columns_of(rows)
        try:
            values = self.user[name](prompts=list(prompts), completions=list(completions), **columns)
        except InputError:
            raise
        except Exception as exc:
            raise InputError(f"{where} raised {_exc(exc)} (on completion {completions[0][:80]!r}; it is called "
                             f"as fn(prompts, completions, {', '.join(columns)}))") from None
        return _check_scores(values, len(completions), where)

    def total(self, parts: dict[str, list[float | None]]) -> list[float]:
        """The weighted sum per completion (None counts 0), summed in the order of `names`."""
        n = len(next(iter(parts.values())))
        out = [0.0] * n
        for name, w in zip(self.names, self.weights):
            out = [t + w * v if v is not None else t for t, v in zip(out, parts[name])]
        return out

    def score(self, prompts, completions, rows) -> tuple[list[float], dict[str, list[float | None]]]:
        """(the reward, each part) per completion."""
        parts = self.parts(prompts, completions, rows)
        return self.total(parts), parts

    def probe(self, row: dict[str, Any]) -> None:
        """Call every user part once on `row` (two completions), so a broken function stops the stage at
        its start, not after the first rollout."""
        if self.user:
            self.score([row["prompt"]] * 2, ["", f"{ANSWER_OPEN}{row['gold']}{ANSWER_CLOSE}"], [row, row])


def columns_of(rows: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """The rows' columns as TRL passes them, each a list aligned with the rows: a task of yours its source's
    columns, a built-in task its prepared row's fields (`gold`, `question`, ...) but the prompt."""
    cols = [r["columns"] if "columns" in r else {k: v for k, v in r.items() if k != "prompt"} for r in rows]
    names = list(dict.fromkeys(k for c in cols for k in c))
    return {k: [c.get(k) for c in cols] for k in names if k not in ("prompts", "completions")}


def task_rewards(cfg: Config, task: str) -> TaskRewards:
    """The checker and reward parts of `task`: a built-in one's, or those `tasks.<task>` names (user
    functions imported and checked here)."""
    if task in BUILTIN_PARTS:
        answer, names, weights = BUILTIN_PARTS[task]
        return TaskRewards(task, Checker(answer), list(names), list(weights))
    t: TaskConfig = cfg.tasks[task]
    user_checker = None
    if ":" in t.answer:
        user_checker = import_function(t.answer, f"tasks.{task}.answer")
    user = {part_name(spec): import_function(spec, f"tasks.{task}.rewards") for spec in t.rewards if ":" in spec}
    return TaskRewards(task, Checker(t.answer, user_checker), [part_name(s) for s in t.rewards],
                       list(t.reward_weights), user)


def part_name(spec: str) -> str:
    """A reward part's name in logs (`reward/<name>`): a built-in's, or a user function's own name (as TRL
    names it), which MLflow's metric names allow (no `:`)."""
    return spec.rsplit(":", 1)[-1]


NUMBER_REWARDS = TaskRewards("gsm8k", Checker("number"), ["correct", "format"], [1.0, 0.2])  # gsm8k's and arith's
