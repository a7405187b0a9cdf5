"""Serve the pipeline as a scheduled Prefect deployment (visible and triggerable in the Prefect UI).

Start a server (UI at http://127.0.0.1:4200) and, from the repo root, serve the flow on a cron::

    prefect server start --host 127.0.0.1                      # terminal 1
    export PREFECT_API_URL=http://127.0.0.1:4200/api           # terminal 2
    python -m flows.serve --cron "0 3 * * *" --params params.yaml

The serving process polls the server and runs scheduled or UI-triggered runs itself, in this working
directory (so outputs land in the repo like ``dvc repro``). One run at a time, decided by the server:
the deployment carries a concurrency limit of 1 (``global_limit``), so a run triggered while another
is running waits in the queue, whichever worker or UI started it (the workspace lock backs it up).
Ctrl-C stops serving and pauses the schedule. Trigger a run from the CLI with
``prefect deployment run grpo-pipeline/nightly`` (``-p overrides='["grpo.kl_coef=0.02"]'``: an
experiment, see flows/grpo_pipeline.py).

A serving process killed outright (``kill -9``) leaves its run RUNNING, holding the slot; the next
start ends such runs first (Crashed, one line each: flows/reconcile.py), so the next trigger starts
at once instead of after Prefect's 5-minute lease.
"""

from __future__ import annotations

import argparse
import sys

from prefect.deployments.runner import EntrypointType

from flows.grpo_pipeline import effective_overrides, grpo_pipeline
from flows.reconcile import reconcile, record_process
from pipeline.core.cli import add_config_args, exit_status
from pipeline.core.errors import InputError


def check_schedule(cron: str, timezone: str | None) -> None:
    """A cron expression and timezone Prefect accepts, or one line saying what is allowed."""
    from pydantic import ValidationError

    from prefect.client.schemas.schedules import CronSchedule

    try:
        CronSchedule(cron=cron, timezone=timezone or "UTC")
    except ValidationError as exc:
        why = exc.errors()[0].get("msg", "invalid") if exc.errors() else "invalid"
        raise InputError(f"--cron {cron!r}{f' --timezone {timezone!r}' if timezone else ''}: {why}; "
                         f"a cron expression has five fields, e.g. '0 3 * * *' (daily 03:00)") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flows.serve", description=__doc__.splitlines()[0])
    p.add_argument("--name", default="nightly", help="deployment name (default: nightly)")
    p.add_argument("--cron", default="0 3 * * *", help='cron schedule (default: "0 3 * * *", daily 03:00)')
    p.add_argument("--timezone", default=None, help="IANA timezone of the cron (default: UTC)")
    add_config_args(p, params_help="params file the scheduled runs use",
                    set_help="override one param for the scheduled runs; repeatable")
    p.add_argument("--paused", action="store_true", help="create the schedule paused (trigger by hand)")
    return p


def reconcile_on_start(deployment_name: str) -> None:
    """End the runs a killed serving process left holding the deployment's slot, before serving;
    housekeeping, so a failure is one line on stderr and serving goes on (it fails alone if the
    server is down)."""
    try:
        reconcile(deployment_name)
    except Exception as exc:  # noqa: BLE001 - any failure here must not keep the schedule from being served
        print(f"warning: could not end the runs a killed serving process left: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def check() -> int:
        effective_overrides(args.params, args.overrides)  # refuse to schedule a config that cannot run
        check_schedule(args.cron, args.timezone)
        return 0

    if code := exit_status(check):
        return code
    from prefect.schedules import Cron

    reconcile_on_start(f"{grpo_pipeline.name}/{args.name}")
    served = grpo_pipeline.with_options(on_running=[*grpo_pipeline.on_running_hooks, record_process])
    served.serve(
        name=args.name,
        schedules=[Cron(args.cron, timezone=args.timezone)] if args.timezone else None,
        cron=None if args.timezone else args.cron,
        paused=args.paused,
        parameters={"params_path": args.params, "overrides": args.overrides},
        tags=["grpo"],
        description="GRPO pipeline: prepare -> sft -> (warmup, control side by side) -> grpo -> evaluate",
        global_limit=1,  # the deployment's concurrency limit, held by the server
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
