"""Runs a killed serving process left behind: found and ended when ``python -m flows.serve`` starts.

``kill -9`` of a serving process (with its process group, as a terminal's or a supervisor's kill
does) takes its flow-run process along, and nothing tells the server: the run stays RUNNING for ever,
and it holds the deployment's single concurrency slot until Prefect's lease on it expires (the flow
process renewed it for 300 s), so the next trigger waited about 5 minutes.

Prefect 3's served runs record no process on the flow run (``infrastructure_pid`` is set by workers
only), so the served flow gets an ``on_running`` hook, :func:`record_process`, that writes its own
process as ``host:pid`` there. At its start, before serving, :func:`reconcile` ends each of the
deployment's RUNNING, PENDING or CANCELLING runs whose recorded process is gone from this host:
Crashed (a Cancelling one Cancelled: the only end Prefect allows it), with a message saying the
serving process was killed. Leaving Running/Cancelling is what releases the slot: the server's
``ReleaseFlowConcurrencySlots`` gives the run's lease back on that transition. Runs of live processes,
of other hosts, or with no record (a run killed in the seconds between Pending and Running) are left
alone: nothing here can tell that they are dead.

One case is left RUNNING on purpose: a dead run whose lease is gone (expired, or forgotten by a
restarted server: Prefect keeps leases in memory) while every slot the server counts could be another
live run's. The server gives a slot back for every run leaving Running, lease or not, so ending it
then could free the slot of a run in progress; the next start ends it. With more slots counted than
live runs (one the gone lease left counted), or none, it is ended.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from pipeline.core.lock import pid_alive

LIVE_TYPES = ("RUNNING", "PENDING", "CANCELLING")


def this_process() -> str:
    """This process as recorded on a flow run: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def record_process(flow: Any, flow_run: Any, state: Any) -> None:
    """``on_running`` hook of the served flow, run in the flow-run process: record that process on
    the run, so a later serving process on this host can tell a dead run from a live one."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run.id, infrastructure_pid=this_process())


def dead_here(infrastructure_pid: str | None, host: str) -> int | None:
    """The pid of a recorded ``host:pid`` whose process is gone from this host, else None: another
    host's, a live one, none, or a worker's bare pid is not this process's to judge."""
    where, _, pid = (infrastructure_pid or "").rpartition(":")
    return int(pid) if where == host and pid.isdigit() and not pid_alive(int(pid)) else None


def live_runs(client: Any, deployment_id: Any) -> list[Any]:
    """The deployment's runs the server counts as in progress (Running, Pending, Cancelling)."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterDeploymentId, FlowRunFilterState,
                                                FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType

    flt = FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]),
                        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType(t) for t in LIVE_TYPES])))
    return client.read_flow_runs(flow_run_filter=flt)


def lease_held(client: Any, run: Any) -> bool:
    """Whether the run still holds its deployment-concurrency lease (asked by renewing it for the
    server's minimum, 60 s: the server has no call that only reads a lease)."""
    import httpx

    lease_id = run.state.state_details.deployment_concurrency_lease_id if run.state else None
    if lease_id is None:
        return False
    try:
        client.renew_concurrency_lease(lease_id, lease_duration=60)
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code in (404, 410):  # 410 Gone: expired or revoked (404 on older servers)
            return False
        raise
    return True


def would_take_a_live_slot(client: Any, deployment_name: str, others: int) -> bool:
    """Whether ending a run whose lease is gone could free a slot another run holds: the server gives
    a slot back for it anyway, which is right only when it counts more slots than the ``others`` live
    runs can hold (a count the gone lease left behind: Prefect keeps leases in memory, so a restarted
    server forgets them) or none at all (nothing to take)."""
    limit = client.read_deployment_by_name(deployment_name).global_concurrency_limit
    active = limit.active_slots if limit else 0
    return 0 < active <= others


def end_ghost(client: Any, run: Any, where: str) -> str:
    """Crashed (Cancelled if it was Cancelling), saying why; returns the state's name."""
    from prefect.states import Cancelled, Crashed

    why = f"the serving process was killed: this run's process ({where}) is gone; ended by flows.serve at its next start"
    state = Cancelled(message=why) if run.state.is_cancelling() else Crashed(message=why)
    result = client.set_flow_run_state(run.id, state)
    if result.status.value != "ACCEPT":
        raise RuntimeError(f"the server did not accept {state.name} for run {run.name!r}: {result.details}")
    return state.name


def reconcile(deployment_name: str) -> list[str]:
    """End the runs of ``flow/deployment`` whose recorded process is gone from this host, printing
    one line per run; returns their ids. A deployment not registered yet has none."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    host = socket.gethostname()
    with get_client(sync_client=True) as client:
        try:
            deployment = client.read_deployment_by_name(deployment_name)
        except ObjectNotFound:
            return []
        runs = live_runs(client, deployment.id)
        ghosts = [(r, f"{host}:{pid}") for r in runs if (pid := dead_here(r.infrastructure_pid, host)) is not None]
        held = {r.id: lease_held(client, r) for r, _ in ghosts}
        ghosts.sort(key=lambda g: not held[g[0].id])  # slot holders first: their slots are surely theirs
        return [str(run.id) for run, where in ghosts
                if end_or_leave(client, run, where, held[run.id]
                                or not would_take_a_live_slot(client, deployment_name, len(runs) - len(ghosts)))]


def end_or_leave(client: Any, run: Any, where: str, safe: bool) -> bool:
    """End one dead run if that frees no other run's slot (``safe``), else leave it; one line either way."""
    was = run.state.type.value.capitalize()
    if not safe:
        print(f"left run {run.name!r} ({run.id}) {was}: its process ({where}) is gone, but so is its lease, "
              f"and the deployment's slots may be other runs' now; a later start ends it", flush=True)
        return False
    name = end_ghost(client, run, where)
    print(f"reconciled run {run.name!r} ({run.id}): {was} -> {name}, its process ({where}) is gone "
          f"(the serving process was killed); the deployment's slot is free", flush=True)
    return True
