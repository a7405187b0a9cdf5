"""What every command line of the project shares (``python -m pipeline`` and the flows' entry
points): ``--params FILE`` with repeatable ``--set section.key=value``, and a user's mistake (a bad
config, a bad input file, a busy workspace, a full disk) as one line ``error: ...`` on stderr with
exit status 2 instead of a traceback."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from pipeline.core.config import ConfigError
from pipeline.core.errors import InputError, TrainingDivergedError
from pipeline.core.files import storage_errno
from pipeline.core.progress import write_report


def add_config_args(parser: argparse.ArgumentParser, params_help: str = "params file (default: params.yaml)",
                    set_help: str = "override one param (DVC's -S grammar); repeatable") -> None:
    parser.add_argument("--params", default="params.yaml", help=params_help)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help=set_help)


def exit_status(run: Callable[[], int]) -> int:
    """`run()`'s exit status, or 2 after one `error: ...` line for a user's mistake or a stop the
    user must act on (a diverged run: its last good checkpoint is intact), reported as well."""
    try:
        return run()
    except (ConfigError, InputError, TrainingDivergedError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        write_report({"error": str(exc), "kind": getattr(exc, "kind", "input")})
        return 2
    except Exception as exc:  # a write no module turned into a StorageError: still one line, not a traceback
        code = storage_errno(exc)
        if code is None:
            raise
        print(f"error: {getattr(exc, 'filename', None) or 'a file'}: cannot write ({os.strerror(code)}); "
              "free space or raise the limit and re-run", file=sys.stderr)
        return 2
