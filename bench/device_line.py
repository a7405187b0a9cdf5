"""The one JSON line of a bench/device_check.sh step, from its exit status and its output file.

    python bench/device_line.py STEP EXIT SECONDS LIMIT OUTPUT_FILE [--skipped WHY]

Every step reports the same keys, so a reader of results.jsonl needs no per-step parsing: ``step``,
``ok`` (exit 0 and not skipped), ``seconds``, ``limit_s``, ``timed_out`` (exit 124: the step's limit
cut it), ``tokens_per_s``, ``mfu`` (against the bf16 matmul peak measured on the GPU; on a CPU dry
run the fp32 peak of the iteration's shapes), ``peak_mem_gb`` (``torch.cuda.max_memory_allocated``,
1e9 bytes; null on a CPU), and where the output says: the iteration's seconds, the device, the
compiled graphs, the tests' summary line, or the output's last lines when the step failed.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

TAIL_LINES = 5  # of a failed step's output, so the line says why without opening the file


def last_json(text: str) -> dict:
    """The last line of `text` that is a JSON object (bench scripts end with one), else {}."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return {}


PYTEST_SUMMARY = re.compile(r"^=*\s*(\d+ (passed|failed|skipped|deselected|errors?)\b.* in [\d.]+s)")


def pytest_summary(text: str) -> str | None:
    """pytest's closing count line ("3 passed, 2 skipped in 9.1s"), if there is one."""
    found = [m.group(1) for m in map(PYTEST_SUMMARY.match, text.splitlines()) if m]
    return found[-1] if found else None


def figures(result: dict) -> dict:
    """tokens/s, MFU and peak memory of a bench/grpo_iteration.py result."""
    gib = result.get("max_cuda_memory_gib")
    return {"tokens_per_s": result.get("tokens_per_s"), "mfu": result.get("fraction_of_peak"),
            "peak_mem_gb": None if gib is None else round(gib * 2**30 / 1e9, 3),
            "seconds_per_iteration": result.get("seconds_per_iteration"), "device": result.get("device"),
            **({"compiled_graphs": result["compiled_graphs"]} if "compiled_graphs" in result else {})}


def step_line(step: str, rc: int, seconds: int, limit: int, text: str, skipped: str | None = None) -> dict:
    ok = rc == 0 and skipped is None
    line = {"step": step, "ok": ok, "seconds": seconds, "limit_s": limit, "exit": rc, "timed_out": rc == 124,
            "tokens_per_s": None, "mfu": None, "peak_mem_gb": None}
    if skipped is not None:
        line["skipped"] = skipped
    line.update({k: v for k, v in figures(last_json(text)).items() if v is not None})
    summary = pytest_summary(text)
    if summary is not None:
        line["tests"] = summary
    if not ok and text:
        line["tail"] = text.splitlines()[-TAIL_LINES:]
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step")
    ap.add_argument("exit", type=int)
    ap.add_argument("seconds", type=int)
    ap.add_argument("limit", type=int)
    ap.add_argument("output", nargs="?", default=None)
    ap.add_argument("--skipped", default=None, help="why the step did not run")
    args = ap.parse_args()
    path = Path(args.output) if args.output else None
    text = path.read_text(errors="replace") if path is not None and path.is_file() else ""
    print(json.dumps(step_line(args.step, args.exit, args.seconds, args.limit, text, args.skipped)), flush=True)


if __name__ == "__main__":
    main()
