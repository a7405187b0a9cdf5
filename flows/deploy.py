"""Deploy the pipeline to a Prefect work pool, for workers on one machine or many.

``python -m flows.serve`` runs every flow run inside its own process on one machine. Past that, a
process work pool takes the runs and a worker on each training machine picks them up::

    prefect server start --host 127.0.0.1                  # one server (or Prefect Cloud)
    python -m flows.deploy --pool training --source https://example.com/you/grpo-pipeline.git
    prefect worker start --pool training --type process --limit 1     # on each training machine
    prefect deployment run grpo-pipeline/sweep -p overrides='["grpo.kl_coef=0.02"]'

Each flow run clones ``--source`` at ``--branch`` into a fresh folder on its worker's machine (a
Prefect ``git_clone`` pull step), runs every stage there as a DVC experiment, then shares what it
made and leaves nothing behind: ``dvc exp push <share> <name>`` sends the experiment (its params,
``dvc.lock``, metrics and plots as a git ref) to the source's git remote and its outputs (data,
checkpoints) to the repository's default DVC remote, and the MLflow runs go to the tracking server
the workers name (``MLFLOW_TRACKING_URI`` in their environment, or ``tracking.uri``). Any machine
then has a run's results with ``dvc exp pull origin <name>``, ``dvc exp branch <name> <branch>``,
``git checkout <branch>`` and ``dvc pull dvc.yaml``.

The runs of a pool are independent (each in its own clone), so a sweep's runs go side by side, as
many per machine as its worker's ``--limit``. Docker and Kubernetes pools take the same deployment
with an image that holds the environment (``--pool-type docker`` / ``kubernetes`` and
``prefect worker start --type docker``; the ``prefect-docker`` / ``prefect-kubernetes`` package on
the workers): the clone, the stages and what is shared are the same.
"""

from __future__ import annotations

import argparse
import sys

from pipeline.core.cli import exit_status
from pipeline.core.errors import InputError

ENTRYPOINT = "flows/grpo_pipeline.py:grpo_pipeline"


def ensure_pool(name: str, pool_type: str) -> None:
    """The work pool `name`, created with Prefect's default job template for `pool_type` if missing."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type=pool_type))
        except ObjectAlreadyExists:
            pool = client.read_work_pool(name)
            if pool.type != pool_type:
                raise InputError(f"--pool {name}: an existing pool of type {pool.type}, not {pool_type}") from None


def deploy(pool: str, source: str, branch: str | None, name: str, share: str, pool_type: str = "process",
           image: str | None = None, cron: str | None = None) -> str:
    """Register deployment ``grpo-pipeline/<name>`` on ``pool``; its runs clone ``source`` and push to ``share``."""
    from prefect.runner.storage import GitRepository

    from flows.grpo_pipeline import grpo_pipeline

    ensure_pool(pool, pool_type)
    flow = grpo_pipeline.from_source(GitRepository(url=source, branch=branch), ENTRYPOINT)
    flow.deploy(name=name, work_pool_name=pool, image=image, build=False, push=False, cron=cron,
                parameters={"share": share}, print_next_steps=False,
                description="GRPO pipeline: each run clones the repository, runs the stages as a DVC "
                            "experiment and pushes it (dvc exp push)")
    return f"{grpo_pipeline.name}/{name}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.deploy", description=__doc__.splitlines()[0])
    p.add_argument("--pool", required=True, help="work pool name (created if missing)")
    p.add_argument("--source", required=True, help="git URL (or path) of the repository the workers clone")
    p.add_argument("--branch", default=None, help="branch to clone (default: the remote's default)")
    p.add_argument("--name", default="sweep", help="deployment name (default: sweep)")
    p.add_argument("--share", default="origin",
                   help="git remote each run pushes its experiment to (default: origin, the source)")
    p.add_argument("--pool-type", default="process", choices=["process", "docker", "kubernetes"])
    p.add_argument("--image", default=None, help="the image of a docker or kubernetes pool's runs")
    p.add_argument("--cron", default=None, help="also run on this schedule")
    args = p.parse_args(argv)

    def run() -> int:
        if args.pool_type != "process" and not args.image:
            raise InputError(f"--pool-type {args.pool_type}: give --image, the image its runs start from")
        if args.cron:
            from flows.serve import check_schedule

            check_schedule(args.cron, None)
        name = deploy(args.pool, args.source, args.branch, args.name, args.share, args.pool_type, args.image,
                      args.cron)
        print(f"deployment {name} on work pool {args.pool}; start a worker on each machine: "
              f"prefect worker start --pool {args.pool} --type {args.pool_type}")
        return 0

    return exit_status(run)


if __name__ == "__main__":
    sys.exit(main())
