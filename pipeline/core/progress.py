"""The one progress display of every stage: a live bar on stderr when it is a terminal, else none.

Lines worth keeping (a logged step, a decision, a skipped input) go to the ``pipeline`` logger, not
to the bar and never to ``print``: the CLI shows them on stderr (above a live bar) and Prefect
captures them. Tasks take a one-line ``info`` field that the stage updates with its figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def progress_bar(enabled: bool = True) -> Any:
    """A ``rich.progress.Progress`` (use it as a context manager; ``add_task(label, total=..., info="")``,
    ``update``/``advance``), disabled when `enabled` is false or stderr is not a terminal."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    console = Console(stderr=True)
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("eta"),
                    TimeRemainingColumn(), console=console, disable=not (enabled and console.is_terminal))


def duration(seconds: float) -> str:
    """``42s``, ``9m05s``, ``1h02m``: a duration as a log line reads it."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Pace:
    """Time per step and the time left, for the log lines a stage writes (they carry no bar under DVC
    or Prefect). Measured over the steps this process ran: a resumed stage's pace starts at its resume,
    so the wait before it (or a crash) never counts as a slow step."""

    def __init__(self, done: int, total: int, unit: str = "it", clock: Callable[[], float] = time.monotonic):
        self.first, self.total, self.unit, self.clock = done, total, unit, clock
        self.t0 = clock()

    def text(self, done: int) -> str:
        """``2.41 s/it, eta 7m14s`` after `done` of `total` steps; empty before this process ran one."""
        ran = done - self.first
        if ran <= 0:
            return ""
        per = (self.clock() - self.t0) / ran
        return f"{per:.3g} s/{self.unit}, eta {duration(per * max(self.total - done, 0))}"


def as_text(renderable: Any, width: int = 100) -> str:
    """A rich renderable (a table) as plain text, for a log line."""
    import io

    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, record=True)
    console.print(renderable)
    return console.export_text().rstrip()


# --------------------------------------------------------------------------- the command's report

REPORT_ENV = "GRPO_STAGE_REPORT"  # a file the orchestrator names: what the command did, as JSON


def write_report(report: dict) -> None:
    """Tell whoever started this command (the flow's task, through $GRPO_STAGE_REPORT) what it did, as
    JSON: ``{"stage": ..., "ran": true}`` or ``{"error": ..., "kind": "input" | "tracking" | "diverged"}``,
    so that the orchestrator reads no English from the log. Written whole (a temporary file renamed
    over it, by hand: core.files' atomic writers sit a layer above this module, which every command,
    the recipe's model fetch included, imports without making it a DVC dependency); a no-op when the
    variable is unset."""
    import json
    import os
    import tempfile

    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".report-")
    with os.fdopen(fd, "w") as f:
        json.dump(report, f, default=str)
    os.replace(tmp, path)
