"""Checkpoints as MLflow artifacts and registered model versions, tagged with their evaluation."""

from __future__ import annotations

import hashlib
from pathlib import Path

from pipeline.config import CHECKPOINT_DIR, Config
from pipeline.tracking.mlflow_client import CHECKPOINT_TAG, client_for, tracking_uri
from pipeline.tracking.mlflow_logger import MlflowLogger, WithLogger


# --------------------------------------------------------------------------- models

def checkpoint_sha256(folder: Path) -> str | None:
    """Identity of a checkpoint: the SHA-256 of its manifest (which lists every file's SHA-256)."""
    manifest = folder / "manifest.json"
    return hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None


def _size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6


def log_checkpoint(log: MlflowLogger, cfg: Config, stage: str) -> None:
    """Log ``checkpoints/<stage>`` as the run's ``checkpoint`` artifact (if within the size limit);
    register the grpo checkpoint as a new version of ``tracking.registered_model``."""
    folder = Path(CHECKPOINT_DIR) / stage
    sha = checkpoint_sha256(folder)
    if sha is None:
        return
    log.set_tags({CHECKPOINT_TAG: sha})
    size = _size_mb(folder)
    if not 0 < size <= cfg.tracking.log_model_max_mb:
        log.set_tags({"grpo.checkpoint_logged": f"false ({size:.0f} MB > tracking.log_model_max_mb)"})
        return
    log.log_artifact(folder, "checkpoint")
    if stage == "grpo" and cfg.tracking.registered_model:
        log._guard("register_model", WithLogger(_register_uploaded), cfg.tracking.registered_model, sha)


def _register_uploaded(log: MlflowLogger, name: str, sha: str) -> None:
    """Register the run's checkpoint: on the logging thread, after the upload it depends on (or in a
    later run making the calls this one saved), and only if that upload went through."""
    if "log_artifacts" not in log._broken and log.client.list_artifacts(log.run_id, "checkpoint"):
        _register(log.client, name, log.run_id, sha)


def _register(client, name: str, run_id: str, sha: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, description="GRPO policy checkpoints (safetensors + JSON); "
                                                          "load with pipeline.checkpoint.load_policy")
    except MlflowException as exc:
        if "already exists" not in str(exc).lower() and "RESOURCE_ALREADY_EXISTS" not in str(exc):
            raise
    source = client.get_run(run_id).info.artifact_uri.rstrip("/") + "/checkpoint"
    # the same weights evaluated before (a re-run DVC's evaluate then skips, or restores from its run
    # cache): the new version carries that evaluation too, not an empty row in the registry
    earlier = {k: v for mv in client.search_model_versions(f"name = '{name}'")
               if mv.tags.get(CHECKPOINT_TAG) == sha for k, v in mv.tags.items() if k.startswith("eval.")}
    client.create_model_version(name, source, run_id=run_id, tags={CHECKPOINT_TAG: sha, **earlier})


def tag_model_with_eval(cfg: Config, metrics: dict[str, float]) -> int:
    """Put ``metrics`` (the grpo checkpoint's evaluation) on every registered version of the
    checkpoint now in ``checkpoints/grpo``; returns how many versions were tagged."""
    name = cfg.tracking.registered_model
    sha = checkpoint_sha256(Path(CHECKPOINT_DIR) / "grpo")
    if not name or sha is None:
        return 0
    client = client_for(tracking_uri(cfg))
    versions = [v for v in client.search_model_versions(f"name = '{name}'") if v.tags.get(CHECKPOINT_TAG) == sha]
    for v in versions:
        for key, value in metrics.items():
            client.set_model_version_tag(name, v.version, f"eval.{key}", str(value))
    return len(versions)
