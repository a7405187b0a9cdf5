"""An example verifier plug-in: ``grpo.reward=pipeline.rewards.plugins.example:last_integer``.

A dataset whose answers are integers and whose completions end with one: +1.0 when the last integer
in the completion equals the gold, else 0. No format bonus. Copy this file to start your own.
"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"-?\d+")


def last_integer(completion: str, gold) -> float:
    """1.0 if the completion's last integer equals `gold` (an integer, or a float with no fraction)."""
    found = _INTEGER.findall(completion[-200:])
    if not found or gold is None or float(gold) != int(float(gold)):
        return 0.0
    return 1.0 if int(found[-1]) == int(float(gold)) else 0.0
