"""CLI: ``python -m pipeline STAGE [--params FILE] [--set section.key=value ...] [--print-config]``.

The DVC stages call this; the Prefect tasks call the same stage functions directly.
User mistakes (bad config, missing input files, bad data) print one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pipeline.config import STAGES, ConfigError, dump_config, load_config

EXTRA_COMMANDS = ("compare",)



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=[*STAGES, "all", *EXTRA_COMMANDS],
                   help="stage to run ('all' runs every stage in order; 'compare' lists MLflow runs)")
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one param; repeatable")
    p.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.params, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    from pipeline.errors import InputError
    from pipeline.stages import stage_function

    # the stages' progress lines (logging.getLogger(__name__)) on stderr; other libraries stay quiet
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("pipeline")
    root.setLevel(logging.INFO)
    root.addHandler(handler)

    names = STAGES if args.stage == "all" else (args.stage,)
    try:
        if args.stage == "compare":
            from pipeline.tracking import compare_runs

            print(compare_runs(cfg))
            return 0
        for name in names:
            result = stage_function(name)(cfg)
            print(json.dumps({"stage": name, **(result or {})}, default=str))
    except (ConfigError, InputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
