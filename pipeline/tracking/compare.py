"""``python -m pipeline compare``: the experiment's pipeline runs side by side, MLflow's compare
view as text (params that differ, the final headline metrics of each stage).

A column is a flow's parent run (with the metrics of every stage it used: those it ran, and those
DVC let it skip, taken from the run that produced the same outputs), or the stage runs that `dvc
repro`, `dvc exp run` (`--temp`, `--queue`) or `python -m pipeline <stage>` made without a parent,
one column per DVC experiment name (``dvc exp <name>``) or, outside an experiment, per commit
(``dvc repro <commit>``)."""

from __future__ import annotations

from typing import Any

from pipeline.core.config import Config
from pipeline.tracking.mlflow_client import COMMIT_TAG, ROLE_TAG, STAGE_TAG, client_for, experiment_id, tracking_uri

KEY_METRIC_WORDS = ("reward", "kl", "informative", "accuracy", "loss", "format_rate", "pass@", "maj@")
DEFAULT_KEY_PARAMS = ("model.backend", "model.n_embd", "sft.steps", "warmup.iterations", "grpo.iterations",
                      "grpo.kl_coef", "grpo.lr", "grpo.group_size", "grpo.loss_agg", "grpo.adv_norm")


def _key_metric(name: str) -> bool:
    metric = name.rsplit("/", 1)[-1]
    return any(w in metric for w in KEY_METRIC_WORDS) and not metric.endswith("_std")


def _stage_metrics(client, exp_id: str, parent_id: str, all_metrics: bool) -> dict[str, float]:
    """The last value of each metric of each stage run under the parent (metric names carry the stage)."""
    out: dict[str, float] = {}
    children = client.search_runs([exp_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
                                  order_by=["attributes.start_time ASC"])
    for child in children:  # later executions of a stage (resumes) overwrite earlier ones
        out.update(_namespaced(child, all_metrics))
    return out


def _columns_without_parent(client, exp_id: str, max_runs: int, all_metrics: bool) -> list[tuple[int, str, dict, dict]]:
    """(start ms, column name, params, column) for the stage runs that no flow's parent holds, grouped by
    DVC experiment name, else by commit; newest group first."""
    runs = client.search_runs([exp_id], filter_string=f"tags.`{ROLE_TAG}` = 'stage'",
                              order_by=["attributes.start_time ASC"], max_results=5000)
    groups: dict[str, list] = {}
    for r in runs:
        if "mlflow.parentRunId" in r.data.tags:
            continue
        tags = r.data.tags
        name = (f"dvc exp {tags['dvc.exp_name']}" if tags.get("dvc.exp_name")
                else f"dvc repro {tags.get(COMMIT_TAG, '')[:7] or '(no git)'}")
        groups.setdefault(name, []).append(r)
    out = []
    for name, members in groups.items():
        col = {"status": members[-1].info.status, "started": members[0].info.start_time}
        for r in members:  # later executions of a stage overwrite earlier ones
            col.update(_namespaced(r, all_metrics))
        out.append((members[0].info.start_time, name, members[-1].data.params, col))
    return sorted(out, key=lambda c: -c[0])[:max_runs]


def _namespaced(run, all_metrics: bool) -> dict[str, float]:
    stage = run.data.tags.get(STAGE_TAG, run.info.run_name)
    return {key if key.split("/", 1)[0] in (stage, "eval") else f"{stage}/{key}": value
            for key, value in run.data.metrics.items() if all_metrics or _key_metric(key)}


def runs_table(cfg: Config, max_runs: int = 10, all_metrics: bool = False):
    """DataFrame, one column per pipeline run (newest first): params that differ, final metrics.

    Rows are ``param:<section.key>`` and the stage-namespaced metric names (``grpo/reward``,
    ``eval/grpo/gsm8k_accuracy``); only the headline metrics unless ``all_metrics``.
    """
    import pandas as pd

    client = client_for(tracking_uri(cfg))
    exp_id = experiment_id(cfg, client)
    parents = client.search_runs([exp_id], filter_string=f"tags.`{ROLE_TAG}` = 'pipeline'",
                                 order_by=["attributes.start_time DESC"], max_results=max_runs)
    found = []
    for p in parents:
        rid = p.info.run_id
        col: dict[str, Any] = {"status": p.info.status, "started": p.info.start_time}
        # the parent's own copies first (they include the stages DVC skipped), then its live children
        col.update({k: v for k, v in p.data.metrics.items() if all_metrics or _key_metric(k)})
        col.update(_stage_metrics(client, exp_id, rid, all_metrics))
        found.append((p.info.start_time, f"{(p.info.run_name or rid[:8])[:40]} ({rid[:6]})", p.data.params, col))
    found += _columns_without_parent(client, exp_id, max_runs, all_metrics)
    columns: dict[str, dict[str, Any]] = {}
    all_params: dict[str, dict[str, str]] = {}
    for _, name, params, col in sorted(found, key=lambda c: -c[0])[:max_runs]:  # newest first
        col["started"] = pd.Timestamp(col["started"], unit="ms").strftime("%Y-%m-%d %H:%M")
        columns[name], all_params[name] = col, params
    if not columns:
        return pd.DataFrame()
    keys = sorted({k for ps in all_params.values() for k in ps})
    differing = [k for k in keys if len({ps.get(k) for ps in all_params.values()}) > 1]
    shown = differing or [k for k in DEFAULT_KEY_PARAMS if k in keys]
    for name, col in columns.items():
        for k in shown:
            col[f"param:{k}"] = all_params[name].get(k)
    df = pd.DataFrame(columns)
    order = (["status", "started"] + [f"param:{k}" for k in shown]
             + sorted(i for i in df.index if i not in {"status", "started"} and not i.startswith("param:")))
    return df.reindex(order)


def compare_text(cfg: Config, max_runs: int = 10, all_metrics: bool = False) -> str:
    import pandas as pd

    df = runs_table(cfg, max_runs, all_metrics)
    uri = tracking_uri(cfg)
    if df.empty:
        return f"no pipeline or stage runs in experiment {cfg.tracking.experiment!r} at {uri}"
    with pd.option_context("display.max_rows", None, "display.max_columns", None, "display.width", 200,
                           "display.max_colwidth", 40, "display.float_format", "{:.4g}".format):
        return (f"experiment {cfg.tracking.experiment!r} at {uri}: {df.shape[1]} run(s), "
                f"newest first\n{df.to_string(na_rep='-')}")
