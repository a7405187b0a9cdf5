"""RLVR verifiers: pure functions `(completion, gold) -> float` (the reference chapter's section 1.3).

Correctness dominates (+1.0); a small format bonus (+0.2) rewards exactly one well-formed
`<answer>N</answer>` block; the most a completion earns is their sum, 1.2. The bonus stays small so a small model
cannot farm it: an empty or non-numeric tag earns nothing (the reward hack the reference chapter warns about).

Correct means: the answer the grammar of `pipeline.rewards.parsing` reads (its docstring has the rules:
where the answer is, what one number is, what is ambiguous) equals the gold exactly, both as exact
rationals. A float gold is read by its shortest repr (`72.0` -> 72, `0.1` -> 1/10), so `0.0001` is not
`0` and `2**53 + 1` is not `2**53`; there is no tolerance. The one allowance: a float gold cannot hold a
fraction whose decimals never end (1/3), so such a fraction matches the float nearest to it.
Well-formed means: one `<answer>` and one `</answer>`, in that order, around exactly one number of the
grammar and nothing else (`<answer>42</answer>`, `<answer>-3/4</answer>`; not `<answer>42 apples</answer>`).

Plug-in: ``grpo.reward`` / ``warmup.reward`` / ``evaluate.reward`` = ``"module:function"`` names a
user's own ``(completion, gold) -> float`` (for another dataset with checkable answers), e.g.
``pipeline.rewards.plugins.example:last_integer``. Checked once per process, at stage start, before
any work, each failure one line naming the key (exit 2):
1. where it is: the module's file must lie under ``pipeline/rewards/`` (put yours in
   ``pipeline/rewards/plugins/``), a dependency of every stage that scores in ``dvc.yaml``, so
   editing it re-runs those stages; it is found without being imported (``importlib.util.find_spec``);
2. what it is: the file is read, not run: it must define ``function`` at top level with ``def`` and
   two positional parameters (so ``os:system`` or a module-level side effect named by mistake is
   refused before anything is imported);
3. then it is imported by name (never evaluated) and called once on a probe completion: it must
   return a finite number.
Every later score must be a finite number too, and a verifier that raises stops the stage with one
line naming the key, the exception and the completion. Empty: the built-in verifier of each row's
``source``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import math
import numbers
from collections.abc import Callable
from pathlib import Path
from fractions import Fraction
from typing import Any

from pipeline.core.errors import InputError

from pipeline.rewards.parsing import (ANSWER_CLOSE, ANSWER_OPEN, answer_block, exact_number, extract_exact,
                                      is_single_number)

CORRECT_BONUS = 1.0
FORMAT_BONUS = 0.2


def _never_ends(x: Fraction) -> bool:
    """True if `x` has no finite decimal expansion (its denominator has a prime factor other than 2 and 5)."""
    d = x.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    return d != 1


def _nearest(exact: Fraction, other: Any) -> bool:
    """True if `other` is a float and `exact` is a never-ending fraction whose nearest float it is."""
    return isinstance(other, float) and _never_ends(exact) and float(exact) == other


def answers_match(pred: Any, gold: Any) -> bool:
    """Exact equality of two answers (Fraction, int, float by its repr, or a string of one number).

    Non-finite or unreadable is no match; see the module docstring for the one float allowance.
    """
    p, g = exact_number(pred), exact_number(gold)
    if p is None or g is None:
        return False
    return p == g or _nearest(p, gold) or _nearest(g, pred)


def has_well_formed_answer(text: str) -> bool:
    """Exactly one `<answer>...</answer>` block whose content is a single number."""
    if not isinstance(text, str) or text.count(ANSWER_OPEN) != 1 or text.count(ANSWER_CLOSE) != 1:
        return False
    block = answer_block(text)
    return block is not None and is_single_number(block)


def reward_gsm8k(text: str, gold: float | None) -> float:
    """Correctness (dominant) + small format bonus; `gold=None` scores format only."""
    r = 0.0
    if answers_match(extract_exact(text), gold):
        r += CORRECT_BONUS
    if has_well_formed_answer(text):
        r += FORMAT_BONUS
    return r


def reward_arith(text: str, gold: float | None) -> float:
    """The curriculum's reward: the same parser and bonuses as GSM8K (answers are exact numbers)."""
    return reward_gsm8k(text, gold)


REWARDS = {"gsm8k": reward_gsm8k, "arith": reward_arith}


def reward_for(source: str):
    """The verifier for a row's `source` field."""
    try:
        return REWARDS[source]
    except KeyError:
        raise ValueError(f"no verifier for source {source!r}; known: {', '.join(REWARDS)}") from None


Verifier = Callable[[str, Any], float]


PLUGIN_ROOT = Path(__file__).resolve().parent  # pipeline/rewards: a dvc.yaml dep of every stage that scores
PROBE = ("The sum is 4.\n<answer>4</answer>", 4.0)  # what the start-up check scores once


def _plugin_file(spec: str, key: str) -> tuple[str, str, Path]:
    """The module, function and source file `spec` names, found without importing the module itself
    (only the packages above it, which lie under pipeline/rewards/ once the file does)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InputError(f"{key} = {spec!r}: expected module:function, e.g. pipeline.rewards.plugins.example:last_integer")
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        found, why = None, f" ({exc})"
    else:
        why = ""
    if found is None:
        raise InputError(f"{key} = {spec!r}: no module {module_name!r} to import{why}; put it under "
                         f"pipeline/rewards/plugins/ (a module file of this checkout)")
    path = Path(found.origin).resolve() if found.origin and found.has_location else None
    if path is None or not path.is_relative_to(PLUGIN_ROOT) or path.suffix != ".py":
        where = path or "built into Python"
        raise InputError(f"{key} = {spec!r}: {module_name} is {where}, outside pipeline/rewards/; a verifier's "
                         f"file must lie there (e.g. pipeline/rewards/plugins/{module_name.rsplit('.', 1)[-1]}.py), "
                         f"a DVC dependency of every stage that scores, so editing it re-runs them")
    return module_name, attr, path


def _defines(path: Path, attr: str) -> bool:
    """Whether the file defines `attr` at top level with `def` taking two positional arguments."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return False
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == attr:
            a = node.args
            positional = len(a.posonlyargs) + len(a.args)
            required_kwonly = [x for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
            return ((positional >= 2 or a.vararg is not None) and positional - len(a.defaults) <= 2
                    and not required_kwonly)
    return False


class UserVerifier:
    """A user's `(completion, gold) -> float`, named `module:function` (see the module docstring for
    the checks); scores are checked to be finite numbers, and an exception is one line naming the key."""

    def __init__(self, spec: str, key: str) -> None:
        module_name, attr, path = _plugin_file(spec, key)
        if not _defines(path, attr):
            raise InputError(f"{key} = {spec!r}: {path.name} defines no top-level `def {attr}(completion, gold)` "
                             f"(a verifier takes a completion and a gold and returns a number)")
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # the user's module failing at import: one line, not a traceback
            raise InputError(f"{key} = {spec!r}: importing {module_name} failed "
                             f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
        fn = getattr(module, attr, None)
        try:
            inspect.signature(fn).bind("completion", "gold")
        except (TypeError, ValueError):
            raise InputError(f"{key} = {spec!r}: {module_name}.{attr} is not a function of (completion, gold)") from None
        self.spec, self.key, self.fn = spec, key, fn
        self(*PROBE)  # it returns a finite number (or the stage stops here, before any work)

    def __call__(self, completion: str, gold: Any) -> float:
        try:
            value = self.fn(completion, gold)
        except Exception as exc:
            raise InputError(f"{self.key} = {self.spec!r} raised {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]} (on completion {completion[:80]!r}, gold {gold!r})") from None
        try:
            score = float(value) if isinstance(value, numbers.Real) else math.nan
        except (TypeError, ValueError, OverflowError):
            score = math.nan
        if not math.isfinite(score):
            raise InputError(f"{self.key} = {self.spec!r} returned {str(value)[:80]!r}; a verifier returns a finite "
                             f"number (on completion {completion[:80]!r}, gold {gold!r})")
        return score


@functools.lru_cache(maxsize=None)
def _load(spec: str, key: str) -> UserVerifier:
    return UserVerifier(spec, key)


def load_verifier(spec: str, key: str) -> UserVerifier | None:
    """The user's verifier named by `spec` (config key `key`, for messages), or None for the built-in ones.
    Checked and imported once per process, however often a stage asks for it."""
    return _load(spec, key) if spec else None


def rewards_by_source(spec: str, key: str) -> Callable[[str], Verifier]:
    """A row's `source` -> its reward function: the built-in one, or the user's `spec` for every source."""
    user = load_verifier(spec, key)
    return reward_for if user is None else (lambda source: user)


def score(completion: str, gold: Any, source: str, verifier: Verifier | None = None) -> float:
    """The reward of one completion: the user's verifier if given, else the built-in one of `source`."""
    if verifier is not None:
        return verifier(completion, gold)
    return reward_for(source)(completion, gold)
