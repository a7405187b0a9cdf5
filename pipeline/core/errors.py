"""Errors that mean "the user's input is wrong": the CLI prints them as one line, exit code 2."""


class InputError(ValueError):
    """Bad or missing input file/data; the message names the file (and line) and what is allowed."""

    kind = "input"  # what a stage's report (pipeline.core.cli.write_report) calls it


class CheckpointError(InputError):
    """A checkpoint that is missing, truncated, corrupt or does not match the config."""


class StorageError(InputError):
    """A write failed for want of space (disk full, quota, `ulimit -f`); what was there before is intact."""


class TrainingDivergedError(RuntimeError):
    """Too many consecutive non-finite steps; the last good checkpoint is left intact."""

    kind = "diverged"
