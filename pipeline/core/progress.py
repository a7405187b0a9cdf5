"""The one progress display of every stage: a live bar on stderr when it is a terminal, else none.

Lines worth keeping (a logged step, a decision, a skipped input) go to the ``pipeline`` logger, not
to the bar and never to ``print``: the CLI shows them on stderr (above a live bar) and Prefect
captures them. Tasks take a one-line ``info`` field that the stage updates with its figures.
"""

from __future__ import annotations

from typing import Any


def progress_bar(enabled: bool = True) -> Any:
    """A ``rich.progress.Progress`` (use it as a context manager; ``add_task(label, total=..., info="")``,
    ``update``/``advance``), disabled when `enabled` is false or stderr is not a terminal."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console,
                    disable=not (enabled and console.is_terminal))


def as_text(renderable: Any, width: int = 100) -> str:
    """A rich renderable (a table) as plain text, for a log line."""
    import io

    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, record=True)
    console.print(renderable)
    return console.export_text().rstrip()
