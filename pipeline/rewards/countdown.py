"""Countdown verifier: does an arithmetic expression reach the target with each given number once?

The rules
  - the answer is one arithmetic expression over non-negative integer literals written in plain
    decimal (`6`, `20`; not `0x10`, `1_0`, `00`, `1.5`, `True`), the binary operators `+ - * /`
    (`×` and `÷` read as `*` and `/`) and parentheses; nothing else: no unary minus (`-6 + 8`),
    no `**`, `//`, `%`, names, calls, attributes, subscripts, strings, comparisons, lambdas;
  - an optional trailing `= <target>` is allowed (`(6 + 4) * 2 = 20`); any other `=` is refused;
  - the literals used must be exactly the given numbers as a multiset: each one once, all of them;
  - the value, computed exactly with `fractions.Fraction` (so `7 / 2 * 2` is 7, not a float near
    it), must equal the target; a division by zero anywhere is a wrong answer.
Texts over MAX_LENGTH characters and trees deeper than MAX_DEPTH are refused, so a hostile text
costs little time and no deep recursion.

Why no eval: the text is model output. `ast.parse` is used only as a parser; the tree is checked
node by node against the whitelist above and evaluated by this module's own few lines, so no model
text is ever run (`__import__('os').system(...)` is just a refused `Call` node) and no operator
that can blow up (`9 ** 9 ** 9`) exists.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from fractions import Fraction

MAX_LENGTH = 200
MAX_DEPTH = 32
OPERATORS: dict[type[ast.operator], str] = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


@dataclass(frozen=True)
class BinOp:
    """`left op right`, with `op` one of `+ - * /`."""

    op: str
    left: Expr
    right: Expr


Expr = int | BinOp  # a literal or an operation


def parse_expression(text: str) -> Expr | None:
    """The expression `text` spells under the module's rules, or None if it breaks any of them."""
    if len(text) > MAX_LENGTH:
        return None
    source = text.replace("×", "*").replace("÷", "/")
    try:
        tree = ast.parse(source, mode="eval")
        return _convert(tree.body, source, 1)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _convert(node: ast.expr, source: str, depth: int) -> Expr | None:
    """`node` as an Expr if it and all below it are whitelisted and at most MAX_DEPTH deep."""
    if depth > MAX_DEPTH:
        return None
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left = _convert(node.left, source, depth + 1)
        right = _convert(node.right, source, depth + 1)
        if left is None or right is None:
            return None
        return BinOp(OPERATORS[type(node.op)], left, right)
    if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
        # plain decimal only: `0x10`, `1_0` and `00` are ints to Python but not numbers as written
        return node.value if ast.get_source_segment(source, node) == str(node.value) else None
    return None


def evaluate(expr: Expr) -> Fraction | None:
    """The exact value of `expr`, or None if it divides by zero anywhere."""
    if isinstance(expr, int):
        return Fraction(expr)
    left, right = evaluate(expr.left), evaluate(expr.right)
    if left is None or right is None:
        return None
    if expr.op == "+":
        return left + right
    if expr.op == "-":
        return left - right
    if expr.op == "*":
        return left * right
    return left / right if right else None


def numbers_used(expr: Expr) -> list[int]:
    """The integer literals of `expr`, left to right as written."""
    if isinstance(expr, int):
        return [expr]
    return numbers_used(expr.left) + numbers_used(expr.right)


def check_countdown(answer_text: str, target: int, numbers: list[int]) -> bool:
    """True iff `answer_text` uses each of `numbers` exactly once and evaluates exactly to `target`."""
    expr = parse_expression(_without_target(answer_text.strip(), target))
    if expr is None or sorted(numbers_used(expr)) != sorted(numbers):
        return False
    return evaluate(expr) == target


def _without_target(text: str, target: int) -> str:
    """`text` less a trailing `= <target>` (`(6+4)*2 = 20` -> `(6+4)*2`); unchanged otherwise."""
    head, equals, tail = text.rpartition("=")
    return head.rstrip() if equals and tail.strip() == str(target) else text
