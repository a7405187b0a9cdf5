"""Verifier cost on ordinary completions and on a fixed set of 1 MB adversarial strings.

    python bench/rewards.py        # one line per case, then the worst case; last line: JSON

Each case is about one megabyte (10**6 characters) built to hit one part of the parser: many short
numbers, long digit runs, malformed separators, nested braces, many tags, long whitespace; a
megabyte inside one answer tag (letters, words, Unicode minus signs, numbers, `=`, `\\frac`, `or`);
many differently written candidates (tags, boxes, `####` lines, headings); the spellings that
normalization rewrites (vulgar fractions, fullwidth digits, superscripts, `minus`, scale words,
units); and answers restated after a tag. The figure that matters is `worst_s`: the slowest single
`reward_gsm8k` call over the set (each case timed as the fastest of REPEATS calls; the documented bound
is 0.05 s).
"""

import json
import time

from pipeline.rewards.verifiers import reward_gsm8k

MB = 1_000_000
REPEATS = 3  # each case's figure is its fastest of 3 calls: the call's own cost, less a busy machine's pauses


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
    # one megabyte inside one answer tag
    "tag_letters": _fill("a", "<answer>", "</answer>"),
    "tag_words": _fill("word ", "<answer>", "</answer>"),
    "tag_unicode_minus": _fill("\u2212", "<answer>", "</answer>"),
    "tag_numbers": _fill("1 ", "<answer>", "</answer>"),
    "tag_spaces_then_42": _fill(" ", "<answer>", "42</answer>"),
    "tag_equals": _fill("= ", "<answer>", "1</answer>"),
    "tag_frac_open": _fill("\\frac{", "<answer>", "</answer>"),
    "tag_vulgar": _fill("\u00bd", "<answer>", "</answer>"),
    "tag_or": _fill("or ", "<answer>", "</answer>"),
    "tag_unclosed_letters": _fill("a", "<answer>"),
    # many differently written candidates
    "distinct_blocks": "".join(f"<answer>{i}</answer>" for i in range(50_000)),
    "distinct_boxes": "".join(f"\\boxed{{{i}}}" for i in range(90_000)),
    "distinct_markers": "".join(f"#### {i}\n" for i in range(100_000)),
    "headings": "".join(f"#### Step {i}: add\n" for i in range(60_000)),
    "box_nested_then_close": _fill("{", "\\boxed{", "}"),
    # spellings that normalization rewrites
    "vulgar_run": _fill("\u00bd"),
    "fullwidth_digits": _fill("\uff15 "),
    "superscripts": _fill("10\u00b3 "),
    "minus_words": _fill("minus 5 "),
    "frac_shorthand": _fill("\\frac12"),
    "mixed_numbers": _fill("2 1/2 "),
    "scale_words": _fill("5 million "),
    "unit_powers": _fill("cm2 "),
    "or_between_numbers": _fill("1 or "),
    # answers restated after a tag
    "restated_after_tag": _fill("Answer: 5\n", "<answer>5</answer>"),
    "boxes_after_tag": _fill("\\boxed{5}", "<answer>5</answer>"),
}


def main() -> None:
    out = {}
    for name, text in CASES.items():
        times = []
        for _ in range(REPEATS):
            t = time.perf_counter()
            reward_gsm8k(text, 1.0)
            times.append(time.perf_counter() - t)
        out[name] = round(min(times), 4)
        print(f"{name:22s} {len(text) / 1e6:.2f} MB  {out[name]:.4f} s")
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
