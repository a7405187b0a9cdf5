"""RLVR with GRPO on GSM8K: the library behind the CLI, the DVC stages and the Prefect tasks."""

__version__ = "0.1.0"
