"""Lenient answer extraction from model output; linear time, never raises, never evaluates text.

Priority (as in the seed): the content of the last `<answer>...</answer>` block, then GSM8K's
`#### N`, then the last number anywhere in the text. A number may carry thousands separators
(`1,234`), a `$`, a sign, decimals, a trailing period (`42.`) or be a simple fraction (`3/4`).

Tag search uses `str.find`/`str.rfind`, not a lazy `.*?` regex, so an adversarial string with many
unclosed `<answer>` tags cannot trigger quadratic backtracking.
"""

from __future__ import annotations

import math
import re

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"

# sign, then digits with optional separators, decimals and a simple fraction; each piece is
# possessive in effect (what follows a run is optional), so matching is linear in the text
_NUMBER = re.compile(r"(-)?\$?(\d[\d,]*(?:\.\d+)?(?:/\d+)?)")
_SINGLE_NUMBER = re.compile(r"-?\$?\d{1,3}(?:,\d{3})*(?:\.\d+)?(?:/\d+)?\.?|-?\$?\d+(?:\.\d+)?(?:/\d+)?\.?")


def _to_float(body: str) -> float | None:
    body = body.replace(",", "")
    try:
        if "/" in body:
            num, den = body.split("/", 1)
            d = float(den)
            return float(num) / d if d != 0 else None
        value = float(body)
    except (ValueError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def parse_number(text: str) -> float | None:
    """The value of the first number in `text`, or None."""
    return _last_or_first_number(text, last=False)


def last_number(text: str) -> float | None:
    """The value of the last number in `text`, or None."""
    return _last_or_first_number(text, last=True)


def _last_or_first_number(text: str, last: bool) -> float | None:
    found = None
    for m in _NUMBER.finditer(text):
        sign = m.group(1)
        if sign and m.start() > 0 and (text[m.start() - 1].isalnum() or text[m.start() - 1] == ")"):
            sign = None  # "3-5" is a subtraction, not the number -5
        body = m.group(2).rstrip(",")
        value = _to_float(body)
        if value is None:
            continue
        found = -value if sign else value
        if not last:
            break
    return found


def answer_block(text: str) -> str | None:
    """Content of the last complete `<answer>...</answer>` block, or None."""
    end = text.rfind(ANSWER_CLOSE)
    if end < 0:
        return None
    start = text.rfind(ANSWER_OPEN, 0, end)
    if start < 0:
        return None
    return text[start + len(ANSWER_OPEN):end]


def extract_answer(text: str) -> float | None:
    """The final numeric answer in a model's output, or None if it holds no number."""
    if not isinstance(text, str):
        return None
    block = answer_block(text)
    if block is not None:
        value = last_number(block)
        if value is not None:
            return value
    hashes = text.rfind("####")
    if hashes >= 0:
        value = parse_number(text[hashes + 4:])
        if value is not None:
            return value
    return last_number(text)


def is_single_number(text: str) -> bool:
    """True if `text` (stripped) is exactly one number, e.g. `42`, `-3.5`, `$1,234`, `3/4`."""
    s = text.strip()
    return bool(s) and _SINGLE_NUMBER.fullmatch(s) is not None and _to_float(s.rstrip(".").replace("$", "")) is not None
