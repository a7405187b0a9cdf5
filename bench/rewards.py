"""Verifier throughput on ordinary completions and on 1 MB adversarial strings.

    python bench/rewards.py        # last line: JSON with per-case seconds
"""

import json
import time

from pipeline.rewards.verifiers import reward_gsm8k

CASES = {
    "unclosed_tags": "<answer>" * 200_000,
    "close_tags": "</answer>" * 120_000,
    "comma_run": "1," * 500_000,
    "dash_run": "-" * 1_000_000,
    "open_then_spaces": "<answer>1" + " " * 1_000_000,
    "hash_run": "####" * 250_000,
    "digit_run": "9" * 1_000_000,
}


def main() -> None:
    out = {}
    for name, text in CASES.items():
        t = time.perf_counter()
        reward_gsm8k(text, 1.0)
        out[name] = round(time.perf_counter() - t, 4)
        print(f"{name:18s} {len(text) / 1e6:.2f} MB  {out[name]:.4f} s")
    normal = "Natalia sold 48/2 = 24 clips in May. 48+24 = 72. <answer>72</answer>"
    t = time.perf_counter()
    for _ in range(20_000):
        reward_gsm8k(normal, 72.0)
    out["ordinary_per_s"] = round(20_000 / (time.perf_counter() - t))
    print(f"ordinary completions: {out['ordinary_per_s']} / s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
