"""pipeline.core.cli: the one --params/--set parser and the one 'error: ... exit 2' policy every entry point uses."""

from __future__ import annotations

import argparse
import errno

import pytest

from pipeline.core.cli import add_config_args, exit_status
from pipeline.core.config import ConfigError
from pipeline.core.errors import InputError


def _raise(exc):
    def run() -> int:
        raise exc
    return run


@pytest.mark.parametrize("exc", [ConfigError("params.yaml: grpo.lr = -1 is out of range"),
                                 InputError("data/x.jsonl:3: invalid JSON"),
                                 OSError(errno.ENOSPC, "No space left on device", "plots/a.csv")])
def test_a_users_mistake_is_one_line_and_exit_2(exc, capsys):
    assert exit_status(_raise(exc)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_other_errors_and_statuses_pass_through():
    assert exit_status(lambda: 0) == 0 and exit_status(lambda: 3) == 3
    with pytest.raises(PermissionError):
        exit_status(_raise(PermissionError(errno.EACCES, "denied")))


def test_config_args():
    p = argparse.ArgumentParser()
    add_config_args(p)
    args = p.parse_args(["--params", "x.yaml", "--set", "a.b=1", "--set", "c.d=2"])
    assert args.params == "x.yaml" and args.overrides == ["a.b=1", "c.d=2"]
    assert p.parse_args([]).params == "params.yaml"
