"""Answer extraction from model output: a written grammar; exact, linear time, never raises, never evaluates.

Where the answer is looked for (the first kind that is present decides; nothing after it is read)
  1. the `<answer>...</answer>` blocks; only if none closes, the non-blank unclosed ones (each runs to
     the next `<answer>` or the end: `<answer>42`, `<answer>6<answer>`); a `\\boxed{...}` inside a
     block narrows that block to its boxes;
  2. else the `\\boxed{...}` whose braces close;
  3. else the lines after a GSM8K marker `####` that start with a number (`#### 72`; a heading such
     as `#### Step 2: add` is no marker);
  4. else the last number in the text.
In 1-3 every candidate counts: each must hold one number and all must hold the same number, so an
empty or word-only tag (`<answer>I don't know</answer>`), a box without a number, and two blocks or
boxes that disagree earn nothing, and the reasoning's last number is never read in their place.
Text after the last block (in 2, after the last box) may not take the answer back: `or ...` right
after it, or a box, a `####` line or `answer is N` there with another number, make it ambiguous. At
most MAX_CANDIDATES differently written candidates are compared (more is no answer), and a region
longer than MAX_REGION characters holds no answer.

One region (the inside of a block, a box or a marker line) holds one number when
  - after its last `=` there is exactly one number, with any words or units around it
    (`x = 42 apples`, `6 * 7 = 42`, `5 m^2`, `18 cm2`, `25%`);
  - each result stated after an earlier `=` (the first number there, unless it starts an
    expression) is that same number: `48/2 = 24 = 24` is 24, `x = 18, x = 20` is ambiguous;
  - it holds no word `or` (`18 or 20`, `x = 18 or x = 20`, `18 or more`), and the number is not
    hedged (below). At most MAX_EQUALS `=` signs.
The last number of the text (4) is read in a window around the text's last digit; it must not be
an operand or hedged either, and none of the words `or`, `maybe`, `perhaps`, `possibly` may stand
between it and the number before it (`18 or 20`, `probably 18, maybe 20`).

What is one number (after the spellings below are mapped onto plain ASCII)
  - digits with an optional decimal part: `42`, `-3.5`, `.5`, `42.` (a trailing period ends a
    sentence); thousands separators only in valid groups of three (`1,234,567.5`); `1,00`, `1,2,3`,
    `12,34` and `1 000` are ambiguous;
  - scientific notation `2.5e3`, `1E-4`, `2.5 \\times 10^{3}`, `2.5 x 10^3`, `2.5·10³`;
  - a fraction of two plain numbers `3/4`, `\\frac{3}{4}`, `\\frac34`, `\\frac{1}{-2}` (= -1/2, also
    `\\dfrac`, `\\tfrac`), a vulgar fraction `¾`, a mixed number `2 1/2`, `2½`, `2\\frac{1}{2}` (= 5/2);
    `x/0` is no number;
  - a sign (`-`, `+`; the Unicode minus and dashes `− – ‐ ‑ ‒ ﹣ －`, `&minus;` and the words
    `minus`, `negative` before a number all read as `-`) and a currency prefix (`$`, `US$`, `€`, `£`,
    `¥`, `₹`, `Rs.`, `INR`, `USD`, `EUR`, `GBP`), in either order; a currency's period is no decimal
    point (`Rs.500` is 500), nor is a period glued after a word (`No.5` is 5);
  - a scale after the number multiplies it: glued `k`/`K` (thousand), `M` (million), `B`/`bn`
    (billion), or the words hundred, thousand, million, billion, trillion, lakh, crore (`$2.5k` is
    2500, `1.5 million` is 1500000); any other word or symbol after it is a unit and is ignored;
  - fullwidth digits read as digits; `²` and other non-ASCII digits are no digits, except that a
    superscript digit is a power (`10³` is `10^3`); LaTeX `{,}`, `\\,`, `\\$`, `\\%` and `^{\\circ}` read as
    `,`, `,`, `$`, `%` and `°`.
Values are exact rationals (`fractions.Fraction`): no rounding, no tolerance.

What is ambiguous and earns nothing (None)
  - an operand of arithmetic: a number next to `+ - * / × ÷ ^ · :` (or `\\times`, `\\cdot`,
    `\\div`) with a number on the other side (`46 + 2`, `3-5`, `12/25/2023`, `2^10`, `3:30`), a sign
    parted from its digits (`- 5`), two signs (`--5`);
  - a hedged number: after `±`, `√`, `not`, `n't`, `at least`, `at most`, `more than`, `less than`,
    `fewer than`, `greater than`, `≥`, `≤` (`\\geq`, `\\pm`, `+/-` too), or followed by `or`, a bare `+`
    or `below` (`18 or so`, `18+`, `5°C below zero`);
  - a number glued after a word (`x2`, `CO2`, `is5`, `COVID-19`) or a power of anything but a unit;
    a unit's power is no number at all (`m2`, `cm3`, `m^2`, `s^{-2}`);
  - malformed runs: bad thousands groups, two decimal points (`1.2.3`), more than MAX_RUN characters
    in one run of digits and separators, an exponent beyond +-MAX_EXPONENT, a value beyond the
    largest float.

Cost: finding the candidates is C-level (`str.split`, `set`, `find`, `rfind`, a charset-led
`re.search`); only a bounded number of candidates of at most MAX_REGION characters, or a window of
2 * WINDOW characters around the last digit, is normalized and read, so a megabyte costs a few
linear passes (see bench/rewards.py for the worst cases measured).
"""

from __future__ import annotations

import itertools
import re
import sys
from fractions import Fraction

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"
BOXED = "\\boxed{"
MARKER = "####"
MAX_RUN = 100          # characters of digits, separators and exponent in one number
MAX_EXPONENT = 400
MAX_REGION = 5_000     # characters in one block, box or marker line; longer holds no answer
MAX_CANDIDATES = 8     # differently written blocks, boxes or marker lines compared
MAX_PIECES = 64        # differently written pieces between markers looked at
MAX_EQUALS = 16        # `=` signs in one region
WINDOW = 4 * MAX_RUN   # characters either side of the last digit that last_number reads
MAX_BRACES = 64        # brace pairs inside one \\boxed{...}; deeper nesting is no answer
LARGEST = Fraction(sys.float_info.max)

_DIGITS = "0123456789"
_RUN_CHARS = frozenset(_DIGITS + ",.eE+-/$")
_SIGNS = "-+"
_OPERATORS = frozenset("+-*/×÷^·:")
_BINARY_LEFT = frozenset(_DIGITS + ")]}")
_UNITS = frozenset({"m", "cm", "mm", "km", "dm", "ft", "in", "yd", "mi"})  # `18 cm2`: an area
_SCALES = {"k": 10 ** 3, "m": 10 ** 6, "b": 10 ** 9, "bn": 10 ** 9, "hundred": 100, "thousand": 10 ** 3,
           "million": 10 ** 6, "billion": 10 ** 9, "trillion": 10 ** 12, "lakh": 10 ** 5, "crore": 10 ** 7}

# one token: [sign][currency][sign] mantissa [exponent] [/ denominator | x 10^k] [scale]; each optional
# piece starts with a distinct character, so a failed piece backtracks only to the end of the mantissa
_TOKEN = re.compile(
    r"([-+]?)((?:[A-Z]{0,2}\$|[€£¥₹]|Rs\.?|INR|USD|EUR|GBP)?)([-+]?)"
    r"((?:\d[\d,.]*|\.\d[\d,.]*)(?:[eE][-+]?\d+)?)"
    r"(?:/(\d[\d,.]*)|[ \t]*[×·*xX][ \t]*10[ \t]*\^[ \t]*(?:\{[ \t]*([-+]?\d{1,4})[ \t]*\}|([-+]?\d{1,4})))?"
    r"(?:([kKMB]|bn)(?![A-Za-z0-9])|[ \t]*((?i:hundred|thousand|million|billion|trillion|lakh|crore))s?(?![A-Za-z]))?")
_DIGIT = re.compile(r"[0-9]")
_MANTISSA = re.compile(r"(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?", re.ASCII)
_PLAIN = re.compile(r"\s*([-+]?)\s*(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)\s*")
_FRAC = re.compile(r"\\[dt]?frac\s*(\{[^{}]{0,100}\}|\d)\s*(\{[^{}]{0,100}\}|\d)")
_VULGAR = {"½": "1/2", "⅓": "1/3", "⅔": "2/3", "¼": "1/4", "¾": "3/4", "⅕": "1/5", "⅖": "2/5", "⅗": "3/5",
           "⅘": "4/5", "⅙": "1/6", "⅚": "5/6", "⅐": "1/7", "⅛": "1/8", "⅜": "3/8", "⅝": "5/8", "⅞": "7/8",
           "⅑": "1/9", "⅒": "1/10"}
_VULGAR_RE = re.compile("(\\d?)([" + "".join(_VULGAR) + "])")
_SIGN_WORDS = re.compile(r"(?<![A-Za-z])(?:[Mm]inus|[Nn]egative)[ \t]+(?=[$.\d])")
_LATEX = (("^{\\circ}", "°"), ("^\\circ", "°"), ("\\degree", "°"), ("\\%", "%"), ("\\$", "$"), ("{,}", ","),
          ("\\,", ","), ("\\times", "×"), ("\\cdot", "·"), ("\\div", "÷"),
          ("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\pm", "±"), ("\\mp", "∓"), ("+/-", "±"),
          ("\\geq", "≥"), ("\\leq", "≤"), ("\\ge", "≥"), ("\\le", "≤"), ("\\sqrt", "√"), ("&minus;", "-"),
          ("&#8722;", "-"))
_UNICODE = str.maketrans({**{c: "-" for c in "\u2212\u2013\u2010\u2011\u2012\ufe63\uff0d"},
                          **{chr(0xFF10 + i): str(i) for i in range(10)},
                          **{c: "^" + str(i) for i, c in enumerate("⁰¹²³⁴⁵⁶⁷⁸⁹")},
                          "\uff0b": "+", "\uff0e": ".", "\u2044": "/", "\u2215": "/",
                          "\u00a0": " ", "\u2009": " ", "\u202f": " ", "\u2007": " "})
_SPECIAL_DIGITS = re.compile("[" + "".join(_VULGAR) + "\uff10-\uff19⁰-⁹¹²³]")
_SPECIAL_CHARS = "".join(_VULGAR) + "".join(chr(0xFF10 + i) for i in range(10)) + "⁰¹²³⁴⁵⁶⁷⁸⁹"
_OR = re.compile(r"(?<![^\W\d_])or(?![^\W\d_])", re.IGNORECASE)
_HEDGE_BEFORE = re.compile(r"(?:(?<![^\W\d_])(?:not|at least|at most|more than|less than|fewer than|greater than"
                           r")|n't|[±∓√≥≤])[\s$]*$", re.IGNORECASE)
_HEDGE_AFTER = re.compile(r"(?:[ \t]*\+(?![ \t]*[\d.$(])|[\s()*.,;:!]{0,4}or(?![^\W\d_])"
                          r"|[ \t]*(?:°[ \t]*[CF]?|degrees?(?: [CF][a-z]*)?)?[ \t]*below(?![^\W\d_]))", re.IGNORECASE)
_RESTATED = re.compile(r"(?<![</])answer(?!>)(?:[ \t]+(?:is|should be|would be|must be|becomes))?"
                       r"[ \t]*[:=]?[ \t]*(?:\*\*)?", re.IGNORECASE)
_MAYBE = re.compile(r"(?<![^\W\d_])(?:or|maybe|perhaps|possibly)(?![^\W\d_])", re.IGNORECASE)

AMBIGUOUS = object()  # a marker: the region holds something that is not one number
ABSENT = object()     # a marker: this kind of answer (tags, boxes, ####) is not in the text


# --------------------------------------------------------------------------- spellings

def _frac_text(m: re.Match) -> str:
    """`\\frac{a}{b}` as `a/b` with the sign in front (`\\frac{1}{-2}` -> `-1/2`); after a digit, ` a/b`."""
    num, den = _PLAIN.fullmatch(m.group(1).strip("{}")), _PLAIN.fullmatch(m.group(2).strip("{}"))
    if num is None or den is None:
        return m.group(0)
    sign = "-" if (num.group(1) == "-") != (den.group(1) == "-") else ""
    lead = " " if m.start() > 0 and m.string[m.start() - 1] in _DIGITS else ""
    return f"{lead}{sign}{num.group(2)}/{den.group(2)}"


def _vulgar_text(m: re.Match) -> str:
    return m.group(1) + (" " if m.group(1) else "") + _VULGAR[m.group(2)]


def normalize(text: str) -> str:
    """LaTeX, HTML and Unicode spellings mapped onto the plain grammar (`\\frac{3}{4}` -> `3/4`, `−5` -> `-5`).

    Callers pass a bounded piece (a region or a window): the substitutions with a callback cost a
    Python call per match.
    """
    if not text.isascii():
        text = text.translate(_UNICODE)
        if _SPECIAL_DIGITS.search(text):
            text = _VULGAR_RE.sub(_vulgar_text, text)
    for old, new in _LATEX:
        if old in text:
            text = text.replace(old, new)
    if "frac" in text:
        text = _FRAC.sub(_frac_text, text)
    if "inus" in text or "egative" in text:
        text = _SIGN_WORDS.sub("-", text)
    return text


# --------------------------------------------------------------------------- one token

def _mantissa_value(raw: str) -> Fraction | None:
    """The exact value of digits/separators/exponent `raw`, or None if malformed (`1,00`, `1.2.3`)."""
    raw = raw.rstrip(".,")
    if not raw or len(raw) > MAX_RUN or _MANTISSA.fullmatch(raw) is None or not any(c in _DIGITS for c in raw):
        return None
    raw = raw.replace(",", "").lower()
    digits, _, exponent = raw.partition("e")
    if exponent and abs(int(exponent)) > MAX_EXPONENT:
        return None
    whole, _, decimals = digits.partition(".")
    value = Fraction(int(whole + decimals or "0"), 10 ** len(decimals))  # exact, and cheaper than Fraction(str)
    return value * Fraction(10) ** int(exponent) if exponent else value


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


def _is_operator(text: str, k: int) -> bool:
    """`+ - * / × ÷ ^ · :` at `k`, or a lone `x` (`5 x 3`; not the x of a word)."""
    c = text[k]
    return c in _OPERATORS or (c in "xX" and not text[k - 1:k].isalpha() and not text[k + 1:k + 2].isalpha())


def _is_operand(text: str, start: int, end: int) -> bool:
    """True if the number text[start:end] is one side of an arithmetic expression."""
    j = _prev_nonspace(text, start)
    if j >= 0 and _is_operator(text, j) and (text[j] in _SIGNS or _is_binary_operator(text, j)):
        return True  # `46 + 2`, or a sign cut off by a space (`- 5`): not one number
    k = _next_nonspace(text, end)
    if k >= 0 and _is_operator(text, k):
        m = _next_nonspace(text, k + 1)
        return m >= 0 and (text[m] in _DIGITS or text[m] in "($.{")
    return False


def _glue(text: str, m: re.Match) -> str:
    """What stands right before token `m`: "free", a unit's power ("unit": `m2`, `m^2`) or a word ("word": `x2`)."""
    i = m.start()
    before = text[max(0, i - 3):i]
    if before.endswith("^") or before.endswith("^{"):
        base = before[:-1] if before.endswith("^") else before[:-2]
        return "unit" if base[-1:].isalpha() or base[-1:] == "}" else "word"  # `m^2`, `\\text{ cm}^2`
    if i == 0 or m.group(1) or m.group(2):
        return "free"
    if not text[i - 1].isalpha() and not text[i - 1] == "_":
        return "word" if before.endswith("}{") or text[max(0, i - 5):i] == "frac{" else "free"
    j = i
    while j > 0 and i - j < 3 and text[j - 1].isalpha():
        j -= 1
    letters = text[j:i]
    alone = j == 0 or not text[j - 1].isalpha()
    power = m.group(4).rstrip(".,") in ("2", "3") and m.end() == m.end(4)
    return "unit" if alone and letters in _UNITS and power else "word"


def _token_value(text: str, m: re.Match) -> Fraction | object:
    """The exact value of token `m`, or AMBIGUOUS (malformed, an operand, or hedged)."""
    if m.group(1) and m.group(3):
        return AMBIGUOUS  # `--5`, `-$-5`
    sign, start = m.group(1) or m.group(3), m.start()
    if m.group(1) and _is_binary_operator(text, start):
        sign, start = "", start + 1
    value = _mantissa_value(m.group(4))
    if value is None or _is_operand(text, start, m.end()) or _hedged(text, start, m.end()):
        return AMBIGUOUS
    if m.group(5) is not None:
        den = _mantissa_value(m.group(5))
        if den is None or den == 0 or "e" in m.group(4).lower():
            return AMBIGUOUS
        value /= den
    power = m.group(6) or m.group(7)
    if power is not None:
        if abs(int(power)) > MAX_EXPONENT or "e" in m.group(4).lower():
            return AMBIGUOUS
        value *= Fraction(10) ** int(power)
    scale = m.group(8) or m.group(9)
    if scale:
        value *= _SCALES[scale.lower()]
    if abs(value) > LARGEST:
        return AMBIGUOUS
    return -value if sign == "-" else value


def _hedged(text: str, start: int, end: int) -> bool:
    """True if the number text[start:end] is hedged: `at least 5`, `±5`, `not 5`, `5 or so`, `5+`."""
    return (_HEDGE_BEFORE.search(text[max(0, start - 16):start]) is not None
            or _HEDGE_AFTER.match(text, end, end + 32) is not None)


# --------------------------------------------------------------------------- numbers in a piece of text

def _matches(text: str, pos: int = 0, end: int | None = None):
    """The tokens of text[pos:end] in order, with their glue; a period glued after a word (`No.5`) is skipped."""
    end = len(text) if end is None else end
    while True:
        digit = _DIGIT.search(text, pos, end)  # a charset scan in C; a token starts at most 8 characters before it
        m = None if digit is None else _TOKEN.search(text, max(pos, digit.start() - 8), end)
        if m is None:
            return
        glue = _glue(text, m)
        if glue != "free" and m.group(4).startswith(".") and not m.group(2):
            pos = m.start() + 1  # `No.5`: the period ends an abbreviation, the 5 is read next
            continue
        if glue != "unit":
            yield m, glue
        pos = m.end()


def _is_mixed(whole: re.Match, part: re.Match, text: str) -> bool:
    """True if `part` (`1/2`) follows the integer `whole` (`2`) as in `2 1/2`: one proper fraction after a space."""
    gap = text[whole.end():part.start()]
    return (0 < len(gap) <= 2 and gap.strip(" \t") == "" and whole.group(4).isdigit() and whole.lastindex == 4
            and part.group(5) is not None and part.lastindex == 5 and not part.group(1) and not part.group(2)
            and part.group(4).isdigit() and part.group(5).isdigit() and 0 < int(part.group(4)) < int(part.group(5)))


def numbers(text: str, pos: int = 0, end: int | None = None, limit: int = 2) -> list[tuple[object, int, int]]:
    """(value, start, end) of the first `limit` numbers in text[pos:end]; a mixed number `2 1/2` is one.

    A value is a Fraction, or AMBIGUOUS for a number the grammar does not read as one (operand,
    hedge, glued to a word, malformed).
    """
    out: list[tuple[object, int, int]] = []
    last = None
    for m, glue in _matches(text, pos, end):
        if last is not None and _is_mixed(last, m, text) and isinstance(out[-1][0], Fraction):
            whole, part = out[-1][0], _token_value(text, m)
            negative = whole < 0 or "-" in text[out[-1][1]:last.start(4)]  # `-2 1/2`, `-0 1/2`
            value = AMBIGUOUS if part is AMBIGUOUS else whole + (-part if negative else part)
            out[-1], last = (value, out[-1][1], m.end()), None
            continue
        if len(out) == limit:
            break
        out.append((AMBIGUOUS if glue == "word" else _token_value(text, m), m.start(), m.end()))
        last = m
    return out


# --------------------------------------------------------------------------- regions

def _single(text: str) -> object:
    """The one number of `text` (Fraction), None if it holds none, AMBIGUOUS if more or not one number."""
    found = numbers(text, limit=2)
    if not found:
        return None
    return found[0][0] if len(found) == 1 else AMBIGUOUS


def region_value(region: str) -> object:
    """The one number a block, box or marker line holds (Fraction), None if none, AMBIGUOUS if more or hedged."""
    if len(region) > MAX_REGION:
        return AMBIGUOUS
    text = normalize(region)
    if _OR.search(text) is not None or text.count("=") > MAX_EQUALS:
        return AMBIGUOUS
    segments = text.split("=")
    final = _single(segments[-1])
    if not isinstance(final, Fraction):
        return final
    for segment in segments[1:-1]:  # a result stated earlier must be the same number
        first = numbers(segment, limit=1)
        if first and isinstance(first[0][0], Fraction) and first[0][0] != final:
            return AMBIGUOUS
    return final


def _agree(regions) -> object:
    """The number every region holds, or AMBIGUOUS (one holds none or is ambiguous, or they disagree)."""
    value = None
    for region in regions:
        v = region_value(region) if isinstance(region, str) else region
        if not isinstance(v, Fraction) or (value is not None and v != value):
            return AMBIGUOUS
        value = v
    return AMBIGUOUS if value is None else value


def boxed_content(text: str, start: int = 0) -> str | None:
    """Content of a `\\boxed{...}` whose `{` ends just before `start`, if its braces close, or None.

    Each brace is found once (a `find` from the last position), so a megabyte of braces costs one pass.
    """
    i, depth, events = start, 1, 0
    opening, closing = text.find("{", i), text.find("}", i)
    while depth:
        events += 1
        if closing < 0 or events > MAX_BRACES:
            return None
        if 0 <= opening < closing:
            depth, i = depth + 1, opening + 1
            opening = text.find("{", i)
        else:
            depth, i = depth - 1, closing + 1
            closing = text.find("}", i)
    return text[start:i - 1]


def _distinct_pieces(text: str, marker: str) -> set[str] | None | object:
    """The differently written pieces after each `marker`; None if there is none, AMBIGUOUS if too many."""
    parts = text.split(marker)
    if len(parts) == 1:
        return None
    pieces = set(parts[1:])
    return AMBIGUOUS if len(pieces) > MAX_PIECES else pieces


def _boxes(text: str) -> object:
    """The number all closed `\\boxed{}` of `text` agree on; ABSENT if none closes; AMBIGUOUS otherwise."""
    pieces = _distinct_pieces(text, BOXED)
    if pieces is None or pieces is AMBIGUOUS:
        return ABSENT if pieces is None else AMBIGUOUS
    contents = set()
    for piece in pieces:
        inner = boxed_content(piece)
        if inner is not None:
            after = piece[len(inner) + 1:len(inner) + 40].lstrip("$ \t")
            if _OR.match(after) or _HEDGE_AFTER.match(after):
                return AMBIGUOUS  # `\\boxed{18} or more`
            contents.add(inner)
    if not contents:
        return ABSENT
    return AMBIGUOUS if len(contents) > MAX_CANDIDATES else _agree(contents)


def _blocks(text: str) -> object:
    """The number all `<answer>` blocks agree on (a box inside one narrows it); ABSENT if there is none."""
    pieces = _distinct_pieces(text, ANSWER_OPEN)
    if pieces is None or pieces is AMBIGUOUS:
        return ABSENT if pieces is None else AMBIGUOUS
    contents = {p.partition(ANSWER_CLOSE)[0] for p in pieces if ANSWER_CLOSE in p}
    if not contents:  # no block closes: each non-blank one runs to the next `<answer>` or the end
        contents = {p for p in pieces if p.strip()}
    if not contents or len(contents) > MAX_CANDIDATES or any(len(c) > MAX_REGION for c in contents):
        return AMBIGUOUS
    values = []
    for content in contents:
        boxed = _boxes(content) if BOXED in content else ABSENT
        if boxed is not ABSENT and _OR.search(content) is not None:
            return AMBIGUOUS  # `<answer>\\boxed{5} or \\boxed{18}</answer>`
        values.append(content if boxed is ABSENT else boxed)
    return _agree(values)


def _after_last_block(text: str) -> str:
    return text[text.rfind(ANSWER_CLOSE) + len(ANSWER_CLOSE):] if ANSWER_CLOSE in text else ""


def _after_last_box(text: str) -> str:
    piece = text[text.rfind(BOXED) + len(BOXED):]
    inner = boxed_content(piece)
    return piece if inner is None else piece[len(inner) + 1:]


def _contradicted(tail: str, value: Fraction) -> bool:
    """True if the text after the answer (`tail`) hedges (`or 20`) or states another answer: a box, a
    `####` line or `answer is N` with another number (`<answer>18</answer> Actually, the answer is 20.`)."""
    if _OR.match(tail[:40].lstrip(" \t.,;:!()")) or _HEDGE_AFTER.match(tail, 0, 40):
        return True
    if any(found is not ABSENT and found != value for found in (_boxes(tail), _markers(tail))):
        return True
    head = tail[:MAX_REGION]
    for m in itertools.islice(_RESTATED.finditer(head), MAX_CANDIDATES):
        found = numbers(normalize(head[m.end():m.end() + 64]), limit=1)
        if found and found[0][1] <= 2 and isinstance(found[0][0], Fraction) and found[0][0] != value:
            return True
    return False


def _starts_with_number(line: str) -> bool:
    """True if a `####` line starts with a number, not a heading's (`#### 3. Add`, `#### 2) Add`, `#### 1: Add`)."""
    head = normalize(line[:64]).lstrip(" \t*")
    m = _TOKEN.match(head)
    if m is None:
        return False
    rest = head[m.end():].strip(" \t*")
    return not (rest and (m.group(4).endswith(".") or rest[0] in "):"))


def _markers(text: str) -> object:
    """The number all `#### N` lines agree on; ABSENT if no `####` is followed by a number."""
    pieces = _distinct_pieces(text, MARKER)
    if pieces is None or pieces is AMBIGUOUS:
        return ABSENT if pieces is None else AMBIGUOUS
    lines = set()
    for piece in pieces:
        line = piece[:piece.find("\n")] if "\n" in piece[:MAX_REGION + 1] else piece
        if _starts_with_number(line):
            lines.add(line)
    if not lines:
        return ABSENT
    return AMBIGUOUS if len(lines) > MAX_CANDIDATES else _agree(lines)


# --------------------------------------------------------------------------- the last number

def _last_digit(text: str) -> int:
    """Index of the last character that can end a number's digits (ASCII, fullwidth, vulgar), or -1."""
    p = max(text.rfind(d) for d in _DIGITS)
    if not text.isascii() and _SPECIAL_DIGITS.search(text, p + 1) is not None:  # after the last ASCII digit
        p = max(text.rfind(c, p + 1) for c in _SPECIAL_CHARS)
    return p


def last_number(text: str) -> Fraction | None:
    """The exact value of the last number in `text`; None if there is none, or it is ambiguous or hedged.

    Only a window around the last digit is normalized and read: a number is at most MAX_RUN
    characters, so nothing further back can change it.
    """
    p = _last_digit(text)
    if p < 0:
        return None
    lo = max(0, p - WINDOW)
    window = normalize(text[lo:p + WINDOW])
    tokens = [m for m, _ in _matches(window)]
    if not tokens:
        return None
    found = numbers(window, tokens[-3].start() if len(tokens) > 2 else 0, limit=3)  # a mixed number is two tokens
    value, start, _ = found[-1]
    if start == 0 and lo > 0 and text[lo - 1] in _RUN_CHARS:
        return None  # the run goes on beyond the window: longer than any number
    prev_end = found[-2][2] if len(found) > 1 else 0
    if _MAYBE.search(window, max(prev_end, start - 40), start) is not None:
        return None  # `18 or 20`, `x = 18 or x = 20`, `probably 18, maybe 20`
    return value if isinstance(value, Fraction) else None


# --------------------------------------------------------------------------- the answer

def extract_exact(text: str) -> Fraction | None:
    """The final numeric answer in a model's output as an exact rational; None if it holds none or it is ambiguous.

    Never raises, whatever `text` is (non-strings give None).
    """
    if not isinstance(text, str):
        return None
    for kind, after in ((_blocks, _after_last_block), (_boxes, _after_last_box), (_markers, None)):
        found = kind(text)
        if found is ABSENT:
            continue
        if not isinstance(found, Fraction) or (after is not None and _contradicted(after(text), found)):
            return None
        return found
    return last_number(text)


def extract_answer(text: str) -> float | None:
    """`extract_exact` as a float (reports, majority votes); never inf or nan."""
    value = extract_exact(text)
    return None if value is None else float(value)


def answer_block(text: str) -> str | None:
    """Content of the last complete `<answer>...</answer>` block, or None."""
    end = text.rfind(ANSWER_CLOSE)
    if end < 0:
        return None
    start = text.rfind(ANSWER_OPEN, 0, end)
    if start < 0:
        return None
    return text[start + len(ANSWER_OPEN):end]


def single_number(text: str) -> Fraction | None:
    """The value of `text` if it is (stripped) exactly one number of the grammar, e.g. `42`, `-3.5`, `$1,234`, `3/4`."""
    if not isinstance(text, str) or len(text) > MAX_REGION:
        return None
    s = normalize(text).strip()
    if s.endswith(".") and not s.endswith(".."):
        s = s[:-1]
    found = numbers(s, limit=2)
    if len(found) != 1 or found[0][1] != 0 or found[0][2] != len(s):
        return None
    value = found[0][0]
    return value if isinstance(value, Fraction) else None


def is_single_number(text: str) -> bool:
    """True if `text` (stripped) is exactly one number of the grammar."""
    return single_number(text) is not None


def exact_number(x) -> Fraction | None:
    """A gold or predicted answer as an exact rational: an int, a finite float by its shortest repr
    (0.1 -> 1/10, 2.0**53 -> 9007199254740992), a Fraction, or a string holding exactly one number; else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, Fraction):
        return x
    if isinstance(x, int):
        return Fraction(x)
    if isinstance(x, float):
        if x != x or abs(x) == float("inf"):
            return None
        return Fraction(int(x)) if x.is_integer() and abs(x) <= 2 ** 53 else Fraction(repr(x))
    return single_number(x) if isinstance(x, str) else None


def parse_gold(gold) -> float | None:
    """A gold answer as a float: a finite number, or a string holding exactly one number; else None."""
    value = exact_number(gold)
    return None if value is None else float(value)
