"""CLI: ``python -m pipeline STAGE [--params FILE] [--set section.key=value ...] [--print-config]``.

The DVC stages call this (and the Prefect tasks run the DVC stages). ``all`` runs every stage in
this process under one MLflow parent run and the workspace lock; ``summary`` prints the headline
numbers of the workspace; ``compare`` lists the experiment's MLflow runs side by side.
User mistakes (bad config, missing input files, bad data, a busy workspace) print one line on
stderr and exit 2. A stage with ``nproc > 1`` (sft, control, warmup, grpo) is started here under torchrun, one
process per rank, holding the workspace lock for its ranks; the stages themselves never start processes.
Before a stage imports torch, ``model.cpu_kernels`` pins torch's and MKL's CPU kernels
(``pipeline.core.kernels``), for this process and the processes it starts.
SIGTERM stops a stage the way Ctrl-C does (:class:`Stopped`, a KeyboardInterrupt): its MLflow run
ends KILLED, its resume state stays, and it prints one line saying how to resume (exit 128 + signal).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.cli import add_config_args, exit_status
from pipeline.core.progress import write_report
from pipeline.core.config import STAGES
from pipeline.core.config_loading import dump_config, load_config
from pipeline.core.kernels import apply as pin_cpu_kernels

EXTRA_COMMANDS = ("compare", "summary")
TORCHRUN_STOP_S = 30.0  # how long a stopped launcher lets torchrun stop its ranks before it signals it itself


class Stopped(KeyboardInterrupt):
    """SIGTERM (systemd, Docker, a flow stopping its stages), raised where the stage is: it unwinds
    like Ctrl-C, so the stage's MLflow run ends KILLED and its files are closed, instead of the
    process dying mid-call. The resume state on disk is the same either way."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM raises :class:`Stopped` for the block (in the main thread; elsewhere it is left alone)."""
    def handler(signum: int, _frame) -> None:
        raise Stopped(signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: signals cannot be handled here
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupted(stage: str, exc: KeyboardInterrupt) -> int:
    """One line for a stopped command (no traceback): what stopped, where its resume state is."""
    sig = getattr(exc, "signum", signal.SIGINT)
    pattern = "*.resume" if stage == "all" else f"{stage}.resume"
    kept = sorted(str(p) for p in Path("checkpoints").glob(pattern) if p.is_dir() and any(p.iterdir()))
    note = f"; resume state kept in {', '.join(kept)}" if kept else ""
    if os.environ.get("RANK", "0") == "0":  # one line, not one per torchrun rank
        print(f"interrupted by {signal.Signals(sig).name}: {stage} stopped{note}; run the same command again to "
              "resume", file=sys.stderr)
    return 128 + sig


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at the time, so a live progress bar (which redirects
    stderr while it draws) keeps log lines above itself."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _nproc(cfg, stage: str) -> int:
    return getattr(getattr(cfg, stage, None), "nproc", 1)


def ranks_env(cfg, stage: str, nproc: int, cuda_devices: int) -> dict[str, str]:
    """What the ranks' environment needs beyond ours, given this machine's CUDA device count.

    A model on the CPU: no GPU is visible to the ranks, so they take gloo (with a GPU visible they
    would take NCCL, which has no CPU tensors). A model on CUDA: one device per rank, so `nproc`
    above the device count is an InputError naming the key (NCCL cannot put two ranks on one GPU)."""
    from pipeline.core.errors import InputError

    device = str(cfg.model.device)
    on_cuda = device.startswith("cuda") or (device == "auto" and cuda_devices > 0)
    if not on_cuda:
        return {"CUDA_VISIBLE_DEVICES": ""} if cuda_devices else {}
    if nproc > cuda_devices:
        raise InputError(f"{stage}.nproc = {nproc} needs {nproc} CUDA devices (one per rank) and this machine has "
                         f"{cuda_devices}; set {stage}.nproc to at most {max(cuda_devices, 1)} (or model.device to cpu "
                         "for processes on the CPU)")
    return {}


def check_device(cfg, stage: str, cuda_devices: int) -> None:
    """A stage in one process on `model.device = cuda[:N]`: that device must exist here, else one
    InputError line naming the key (not torch's traceback from the first `.to()`)."""
    from pipeline.core.errors import InputError

    device = str(cfg.model.device)
    if stage == "prepare" or not device.startswith("cuda"):
        return
    index = int(device.partition(":")[2] or 0)
    if index >= cuda_devices:
        have = f"CUDA devices 0-{cuda_devices - 1}" if cuda_devices else "no CUDA device"
        raise InputError(f"model.device = {device}: this machine has {have}; allowed here: auto, cpu"
                         + (f" or cuda:0 to cuda:{cuda_devices - 1}" if cuda_devices else ""))


def run_under_torchrun(cfg, stage: str, nproc: int, nodes: Nodes | None = None) -> int:
    """Run `python -m pipeline STAGE` with this config in `nproc` processes (torchrun, DDP or FSDP; rank 0
    writes the outputs and prints the result line); its exit status. `nodes`: this machine's part of a
    run over several (`nproc` counts the processes of all of them); None: every process here."""
    import torch

    nodes = nodes or Nodes()
    here = nodes.per_node(nproc, stage)
    env = {**os.environ, **ranks_env(cfg, stage, here, torch.cuda.device_count())}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(dump_config(cfg))
        params = f.name
    cmd = [sys.executable, "-m", "torch.distributed.run", *nodes.torchrun_args(), f"--nproc_per_node={here}",
           "-m", "pipeline", stage, "--params", params]
    try:
        return _wait_torchrun(subprocess.Popen(cmd, env=env))
    finally:
        os.unlink(params)


@dataclass(frozen=True)
class Nodes:
    """The machines of a multi-node run (`--nnodes`, `--node-rank`, `--master-addr`, `--master-port`):
    each runs the same command with its own node rank; torchrun's static rendezvous at the master's
    address joins them, node r's processes taking global ranks r * per_node ... (r + 1) * per_node - 1."""

    count: int = 1
    rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def per_node(self, nproc: int, stage: str) -> int:
        from pipeline.core.errors import InputError

        if nproc % self.count:
            raise InputError(f"{stage}.nproc = {nproc} over --nnodes {self.count}: allowed: a multiple of the node "
                             "count (nproc counts the processes of every node, the same number on each)")
        return nproc // self.count

    def torchrun_args(self) -> list[str]:
        if self.count == 1:
            return ["--standalone"]
        return [f"--nnodes={self.count}", f"--node_rank={self.rank}", f"--master_addr={self.master_addr}",
                f"--master_port={self.master_port}"]


def _wait_torchrun(proc: subprocess.Popen) -> int:
    """torchrun's exit status. Stopped (Ctrl-C, SIGTERM), this launcher waits for torchrun to stop its
    ranks (torchrun starts them with setsid, so only torchrun can stop them) instead of killing it at once
    as `subprocess.run` does; it signals torchrun itself only if torchrun is still running then."""
    try:
        return proc.wait()
    except KeyboardInterrupt:
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                proc.send_signal(sig)
            try:
                proc.wait(timeout=TORCHRUN_STOP_S)
                break
            except subprocess.TimeoutExpired:
                continue
        raise



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=[*STAGES, "all", *EXTRA_COMMANDS],
                   help="stage to run ('all': every stage in order; 'compare': MLflow runs; 'summary': headline numbers)")
    add_config_args(p)
    p.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    nodes = p.add_argument_group("several machines (a stage with nproc > 1; the same command on each machine)")
    nodes.add_argument("--nnodes", type=int, default=1, help="machines in the run (nproc counts all their processes)")
    nodes.add_argument("--node-rank", type=int, default=0, help="this machine's rank, 0 .. nnodes - 1")
    nodes.add_argument("--master-addr", default="127.0.0.1", help="address of node 0, where the ranks meet")
    nodes.add_argument("--master-port", type=int, default=29500, help="a free port on node 0")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with stop_on_sigterm():
            return exit_status(lambda: run(args))
    except KeyboardInterrupt as exc:
        return interrupted(args.stage, exc)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.params, args.overrides)
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    # the stages' progress lines (logging.getLogger(__name__)) on stderr; other libraries stay quiet
    handler = _CurrentStderr()
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("pipeline")
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    if args.stage not in EXTRA_COMMANDS:  # before anything imports torch: MKL and torch read these once
        pin_cpu_kernels(cfg.model.cpu_kernels)
    if args.stage == "compare":
        from pipeline.tracking.compare import compare_text

        print(compare_text(cfg))
    elif args.stage == "summary":
        from pipeline.core.summary import headline_table

        print(headline_table())
    elif args.stage == "all":
        return run_all(cfg, _nodes(args))
    else:
        return run_one(cfg, args.stage, _nodes(args))
    return 0


def _nodes(args: argparse.Namespace) -> Nodes:
    from pipeline.core.errors import InputError

    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise InputError(f"--nnodes {args.nnodes} --node-rank {args.node_rank}: allowed: nnodes >= 1 and a node "
                         "rank in [0, nnodes - 1]")
    if not 0 < args.master_port < 65536:
        raise InputError(f"--master-port {args.master_port}: allowed: a port in [1, 65535]")
    return Nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port)


def run_one(cfg, name: str, nodes: Nodes | None = None) -> int:
    """One stage: in this process, or under torchrun when it asks for several (the launcher holds the
    workspace lock, its ranks pass through it); the exit status. `nodes`: this machine's part of a
    multi-node run (docs/distributed.md)."""
    from pipeline.core.lock import workspace_lock
    from pipeline.stages import stage_function

    nproc = _nproc(cfg, name)
    if nproc > 1 and "LOCAL_RANK" not in os.environ:
        with workspace_lock(f"stage {name} (torchrun, {nproc} processes)"):
            code = run_under_torchrun(cfg, name, nproc, nodes)
        if code:
            print(f"error: {name}: torchrun with {nproc} processes failed (exit {code})", file=sys.stderr)
        return code
    if "LOCAL_RANK" not in os.environ and str(cfg.model.device).startswith("cuda"):  # ranks: checked by
        import torch  # their launcher

        check_device(cfg, name, torch.cuda.device_count())
    result = stage_function(name)(cfg)
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps({"stage": name, **(result or {})}, default=str))
        write_report({"stage": name, "ran": True})
    return 0


def run_all(cfg, nodes: Nodes | None = None) -> int:
    """Every stage in order in this process: one workspace lock, one MLflow parent run; `nodes` (the
    node flags, checked like a single stage's) for the stages that run under torchrun."""
    from pipeline.core.lock import workspace_lock
    from pipeline.tracking import PARENT_RUN_ENV, end_pipeline_run, run_name, start_pipeline_run, temporary_env

    with workspace_lock("python -m pipeline all"):
        parent = start_pipeline_run(cfg, name=run_name(cfg, None, "pipeline all"))
        status = "FAILED"
        try:
            with temporary_env({PARENT_RUN_ENV: parent}):
                for name in STAGES:
                    code = run_one(cfg, name, nodes)
                    if code:
                        return code
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            end_pipeline_run(cfg, parent, status)
    return 0


if __name__ == "__main__":
    sys.exit(main())
