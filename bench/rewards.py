"""Verifier cost on ordinary completions and on a fixed set of 1 MB adversarial strings.

    python bench/rewards.py        # one line per case, then the worst case; last line: JSON

Each case is one megabyte (10**6 characters) built to hit one part of the parser: many short
numbers, long digit runs, malformed separators, nested braces, many tags, long whitespace.
The figure that matters is `worst_s`: the slowest single `reward_gsm8k` call over the set.
"""

import json
import time

from pipeline.rewards.verifiers import reward_gsm8k

MB = 1_000_000


def _fill(unit: str, prefix: str = "", suffix: str = "") -> str:
    body = unit * ((MB - len(prefix) - len(suffix)) // len(unit))
    return prefix + body + suffix


CASES = {
    "unclosed_tags": _fill("<answer>"),
    "close_tags": _fill("</answer>"),
    "many_blocks": _fill("<answer>1</answer>"),
    "block_of_numbers": _fill("1 ", "<answer>", "</answer>"),
    "open_then_spaces": _fill(" ", "<answer>1"),
    "short_numbers": _fill("1 "),
    "short_sums": _fill("12 + "),
    "signed_numbers": _fill("-1"),
    "comma_run": _fill("1,"),
    "dot_run": _fill("1."),
    "slash_run": _fill("1/"),
    "exponent_run": _fill("1e"),
    "digit_run": _fill("9"),
    "digits_then_spaces": _fill(" ", "9" * 1000),
    "dash_run": _fill("-"),
    "unicode_minus_run": _fill("\u22121"),
    "dollar_run": _fill("$"),
    "hash_run": _fill("####"),
    "hash_numbers": _fill("#### 1 "),
    "equals_run": _fill("= 1 "),
    "boxed_run": _fill("\\boxed{"),
    "boxed_nested": _fill("{", "\\boxed{"),
    "boxed_closed": _fill("\\boxed{1}"),
    "frac_run": _fill("\\frac{1}{2}"),
    "frac_open": _fill("\\frac{"),
    "latex_ops": _fill("1\\times "),
    "spaces_then_number": _fill(" ", "", "7"),
}


def main() -> None:
    out = {}
    for name, text in CASES.items():
        t = time.perf_counter()
        reward_gsm8k(text, 1.0)
        out[name] = round(time.perf_counter() - t, 4)
        print(f"{name:20s} {len(text) / 1e6:.2f} MB  {out[name]:.4f} s")
    worst = max(CASES, key=out.get)
    out["worst_s"], out["worst_case"] = out[worst], worst
    print(f"worst: {worst} {out[worst]:.4f} s")
    normal = "Natalia sold 48/2 = 24 clips in May. 48+24 = 72. <answer>72</answer>"
    t = time.perf_counter()
    for _ in range(20_000):
        reward_gsm8k(normal, 72.0)
    out["ordinary_per_s"] = round(20_000 / (time.perf_counter() - t))
    print(f"ordinary completions: {out['ordinary_per_s']} / s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
