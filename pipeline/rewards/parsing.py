"""Answer extraction from model output: a deliberate grammar; linear time, never raises, never evaluates.

Where the answer is (first that exists wins)
  1. the last complete `<answer>...</answer>` block (a `\\boxed{...}` inside it narrows it further);
  2. else the last `\\boxed{...}` (braces matched, nesting allowed);
  3. else the first line after the last GSM8K marker `####`;
  4. else the last number anywhere in the text.
In 1-3 the region may carry words and units (`<answer>x = 42 apples</answer>`); only what follows
its last `=` counts, and that must hold exactly one number. A region with no number falls through
to the next place; a region with two or more (`46 + 2`, `1 000`, `3:30`) is ambiguous and earns
nothing: extraction stops there with None, so a model cannot hedge by listing candidates.

What is one number
  - digits with an optional decimal part: `42`, `-3.5`, `.5`, `42.` (a trailing period ends a
    sentence);
  - thousands separators only in valid groups of three: `1,234` and `1,234,567.5`; `1,00`,
    `1,2,3` and `12,34` are ambiguous (a list, or a decimal comma) and earn nothing;
  - scientific notation `2.5e3`, `2.000e+00`, `1E-4`;
  - a fraction of two plain numbers, `3/4` or `\\frac{3}{4}` (also `\\dfrac`, `\\tfrac`); `x/0`
    is no number;
  - an optional sign (`-`, `+`, the Unicode minus `−` U+2212, the en dash `–`) and `$`, in
    either order (`-$5`, `$-5`); LaTeX `{,}` separators and `\\$` are read as `,` and `$`.
A sign counts only when it is not a binary operator: in `3-5` and `3 - 5` the `5` is an operand.

What is ambiguous and earns nothing (None)
  - a sign parted from its digits (`- 5`);
  - an operand of arithmetic: a number next to `+ - * / × ÷ ^ · :` (or `\\times`, `\\cdot`,
    `\\div`) with a number on the other side, as in `46 + 2`, `3-5`, `12/25/2023`, `6 * 7`
    (`= 42` after it is fine: `6 * 7 = 42` is 42);
  - malformed runs: bad thousands groups, two decimal points (`1.2.3`), more than 100 characters
    in one run of digits and separators, an exponent beyond +-400, anything not finite.
Only ASCII digits count; `²` or `٣` are not digits here.

Cost: every step is a C-level scan (`str.find`/`rfind`/`replace`, one `re.sub`, anchored
`re.match`) or a Python loop bounded by a constant (a token is at most 100 characters, at most
two tokens are read in a region), so a 1 MB adversarial string costs a few linear passes; no
pattern has nested quantifiers (see bench/rewards.py for the worst case measured).
"""

from __future__ import annotations

import math
import re

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"
BOXED = "\\boxed{"
MAX_RUN = 100       # characters of digits, separators and exponent in one number
MAX_EXPONENT = 400
WINDOW = 4 * MAX_RUN  # characters either side of the last digit that last_number reads
MAX_BRACES = 64     # brace pairs inside one \\boxed{...}; deeper nesting is no answer

_DIGITS = "0123456789"
_RUN_CHARS = frozenset(_DIGITS + ",.eE+-/$")
_SIGNS = "-+"
_OPERATORS = frozenset("+-*/×÷^·:")
_BINARY_LEFT = frozenset(_DIGITS + ")]}")

# one token: [sign][$][sign] mantissa [exponent] [/ denominator]; every piece after the mantissa is
# optional and starts with a distinct character, so a failed piece never backtracks into the run
_TOKEN = re.compile(r"([-+]?)\$?([-+]?)((?:\d[\d,.]*|\.\d[\d,.]*)(?:[eE][-+]?\d+)?)(?:/(\d[\d,.]*))?", re.ASCII)
_MANTISSA = re.compile(r"(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?", re.ASCII)
_FRAC = re.compile(r"\\[dt]?frac\{\s*([-+]?\d+(?:\.\d+)?)\s*\}\{\s*(\d+(?:\.\d+)?)\s*\}", re.ASCII)
_LATEX = (("\\$", "$"), ("{,}", ","), ("\\times", "×"), ("\\cdot", "·"), ("\\div", "÷"),
          ("\u2212", "-"), ("\u2013", "-"), ("\\left", ""), ("\\right", ""), ("\\!", ""))

AMBIGUOUS = object()  # a marker: the region holds something that is not one number


def normalize(text: str, fractions: int = 0) -> str:
    """LaTeX and Unicode spellings mapped onto the plain grammar (`\\frac{3}{4}` -> `3/4`, `−` -> `-`).

    `fractions` > 0 rewrites at most that many `\\frac`s (a region with two numbers is already
    ambiguous, so two suffice there and a megabyte of fractions costs no more than one).
    """
    for old, new in _LATEX:
        if old in text:
            text = text.replace(old, new)
    if "frac" in text:
        text = _FRAC.sub(r"\1/\2", text, count=fractions)
    return text


def _mantissa_value(raw: str) -> float | None:
    """The value of digits/separators/exponent `raw`, or None if malformed (`1,00`, `1.2.3`)."""
    raw = raw.rstrip(".,")
    if not raw or len(raw) > MAX_RUN or _MANTISSA.fullmatch(raw) is None or not any(c in _DIGITS for c in raw):
        return None
    if "e" in raw or "E" in raw:
        exponent = raw.lower().rsplit("e", 1)[1]
        if abs(int(exponent)) > MAX_EXPONENT:
            return None
    try:
        value = float(raw.replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _prev_nonspace(text: str, i: int) -> int:
    """Index of the last non-space character before `i`, or -1 (looks back at most MAX_RUN)."""
    j = i - 1
    while j >= 0 and text[j] in " \t" and i - j < MAX_RUN:
        j -= 1
    return j if j >= 0 and text[j] not in " \t" else -1


def _next_nonspace(text: str, i: int) -> int:
    j = i
    while j < len(text) and text[j] in " \t" and j - i < MAX_RUN:
        j += 1
    return j if j < len(text) and text[j] not in " \t" else -1


def _is_binary_operator(text: str, k: int) -> bool:
    """True if the operator at `k` joins two operands (`3-5`, `3 - 5`), not a sign (`is -5`)."""
    if k > 0 and text[k] != ":" and (text[k - 1].isalnum() or text[k - 1] in ")]}"):
        return True  # `x-5`, `COVID-19`: glued to a word, a hyphen or a minus, not a sign
    j = _prev_nonspace(text, k)
    return j >= 0 and text[j] in _BINARY_LEFT


def _is_operand(text: str, start: int, end: int) -> bool:
    """True if the number text[start:end] is one side of an arithmetic expression."""
    j = _prev_nonspace(text, start)
    if j >= 0 and text[j] in _OPERATORS and (text[j] in _SIGNS or _is_binary_operator(text, j)):
        return True  # `46 + 2`, or a sign cut off by a space (`- 5`): not one number
    k = _next_nonspace(text, end)
    if k >= 0 and text[k] in _OPERATORS:
        m = _next_nonspace(text, k + 1)
        return m >= 0 and (text[m] in _DIGITS or text[m] in "($.")
    return False


def _token_value(text: str, m: re.Match) -> float | object:
    """The value of token `m`, or AMBIGUOUS (malformed, or an operand of arithmetic)."""
    sign = m.group(1) or m.group(2)
    start = m.start()
    if m.group(1) and _is_binary_operator(text, start):
        sign, start = m.group(2), m.start(2) if m.group(2) else m.start() + 1
    value = _mantissa_value(m.group(3))
    if m.group(4) is not None:
        den = _mantissa_value(m.group(4))
        if value is None or den is None or den == 0 or "e" in m.group(3).lower():
            return AMBIGUOUS
        value = value / den
    if value is None or _is_operand(text, start, m.end()):
        return AMBIGUOUS
    return -value if sign == "-" else value


def _region_value(region: str) -> float | object | None:
    """The one number in a region (after its last `=`), None if it has none, AMBIGUOUS if more."""
    eq = region.rfind("=")
    if eq >= 0:
        region = region[eq + 1:]
    first = _TOKEN.search(region)
    if first is None:
        return None
    if _TOKEN.search(region, first.end()) is not None:
        return AMBIGUOUS
    return _token_value(region, first)


def last_number(text: str) -> float | None:
    """The value of the last number in `text`; None if there is none or it is ambiguous.

    Only a window around the last digit is normalized and read: a number is at most MAX_RUN
    characters, so nothing further back can change it.
    """
    p = max(text.rfind(d) for d in _DIGITS)
    if p < 0:
        return None
    lo = max(0, p - WINDOW)
    window = normalize(text[lo:p + WINDOW])
    p = max(window.rfind(d) for d in _DIGITS)
    s = p
    while s > 0 and window[s - 1] in _RUN_CHARS:  # the run holding the last digit, bounded
        s -= 1
        if p - s > MAX_RUN:
            return None
    if s == 0 and lo > 0 and text[lo - 1] in _RUN_CHARS:
        return None  # the run goes on beyond the window: longer than any number
    last = None
    for last in _TOKEN.finditer(window, s, p + 1 + MAX_RUN):  # a few tokens in one short run
        pass
    value = _token_value(window, last) if last is not None else None
    return None if value is AMBIGUOUS else value


def parse_number(text: str) -> float | None:
    """The value of the first number in `text`; None if there is none or it is ambiguous."""
    text = normalize(text, fractions=1)
    m = _TOKEN.search(text)
    value = _token_value(text, m) if m is not None else None
    return None if value is AMBIGUOUS else value


def answer_block(text: str) -> str | None:
    """Content of the last complete `<answer>...</answer>` block, or None."""
    end = text.rfind(ANSWER_CLOSE)
    if end < 0:
        return None
    start = text.rfind(ANSWER_OPEN, 0, end)
    if start < 0:
        return None
    return text[start + len(ANSWER_OPEN):end]


def boxed_content(text: str) -> str | None:
    """Content of the last `\\boxed{...}` whose braces close, or None."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    i = start + len(BOXED)
    depth, events = 1, 0
    while depth:
        opening, closing = text.find("{", i), text.find("}", i)
        events += 1
        if closing < 0 or events > MAX_BRACES:
            return None
        if 0 <= opening < closing:
            depth, i = depth + 1, opening + 1
        else:
            depth, i = depth - 1, closing + 1
    return text[start + len(BOXED):i - 1]


def _regions(text: str):
    """The answer's candidate regions, in priority order (see the module docstring)."""
    block = answer_block(text)
    if block is not None:
        inner = boxed_content(block)
        yield block if inner is None else inner
    else:
        inner = boxed_content(text)
        if inner is not None:
            yield inner
    hashes = text.rfind("####")
    if hashes >= 0:
        line_end = text.find("\n", hashes)
        yield text[hashes + 4:line_end if line_end >= 0 else len(text)]


def extract_answer(text: str) -> float | None:
    """The final numeric answer in a model's output; None if it holds none or it is ambiguous.

    Never raises and never returns inf or nan, whatever `text` is (non-strings give None).
    """
    if not isinstance(text, str):
        return None
    for region in _regions(text):
        value = _region_value(normalize(region, fractions=2))
        if value is AMBIGUOUS:
            return None
        if value is not None:
            return value
    return last_number(text)


def is_single_number(text: str) -> bool:
    """True if `text` (stripped) is exactly one number of the grammar, e.g. `42`, `-3.5`, `$1,234`, `3/4`."""
    if not isinstance(text, str):
        return False
    s = normalize(text, fractions=2).strip()
    m = _TOKEN.match(s)
    if m is None or s[m.end():] not in ("", "."):
        return False
    return _token_value(s, m) is not AMBIGUOUS


def parse_gold(gold) -> float | None:
    """A gold answer as a float: a finite number, or a string holding exactly one number; else None."""
    if isinstance(gold, bool):
        return None
    if isinstance(gold, (int, float)):
        value = float(gold)
        return value if math.isfinite(value) else None
    if isinstance(gold, str) and is_single_number(gold):
        value = _region_value(normalize(gold, fractions=2))
        return None if value is AMBIGUOUS else value
    return None
