"""``python -m pipeline compare``: the experiment's pipeline runs side by side, MLflow's compare
view as text (params that differ, the final headline metrics of each stage)."""

from __future__ import annotations

from typing import Any

from pipeline.config import Config
from pipeline.tracking.mlflow_client import ROLE_TAG, STAGE_TAG, client_for, experiment_id, tracking_uri

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
        stage = child.data.tags.get(STAGE_TAG, child.info.run_name)
        for key, value in child.data.metrics.items():
            if all_metrics or _key_metric(key):
                out[key if key.split("/", 1)[0] in (stage, "eval") else f"{stage}/{key}"] = value
    return out


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
    columns: dict[str, dict[str, Any]] = {}
    all_params: dict[str, dict[str, str]] = {}
    for p in parents:
        rid = p.info.run_id
        col_name = f"{(p.info.run_name or rid[:8])[:40]} ({rid[:6]})"
        col: dict[str, Any] = {"status": p.info.status,
                               "started": pd.Timestamp(p.info.start_time, unit="ms").strftime("%Y-%m-%d %H:%M")}
        all_params[col_name] = p.data.params
        col.update(_stage_metrics(client, exp_id, rid, all_metrics))
        columns[col_name] = col
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
        return f"no pipeline runs in experiment {cfg.tracking.experiment!r} at {uri}"
    with pd.option_context("display.max_rows", None, "display.max_columns", None, "display.width", 200,
                           "display.max_colwidth", 40, "display.float_format", "{:.4g}".format):
        return (f"experiment {cfg.tracking.experiment!r} at {uri}: {df.shape[1]} pipeline run(s), "
                f"newest first\n{df.to_string(na_rep='-')}")
