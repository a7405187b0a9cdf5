"""Checkpoints as MLflow Models (pyfunc, from code: :mod:`pipeline.policy_model`) of their
stage's run, and the grpo checkpoint as registered model versions, tagged with their evaluation."""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from pathlib import Path

from pipeline.core.config import CHECKPOINT_DIR, Config
from pipeline.tracking.common import temporary_env
from pipeline.tracking.mlflow_client import CHECKPOINT_TAG, client_for, tracking_uri
from pipeline.tracking.mlflow_logger import MlflowLogger, WithLogger


# --------------------------------------------------------------------------- models

def checkpoint_sha256(folder: Path) -> str | None:
    """Identity of a checkpoint: the SHA-256 of its manifest (which lists every file's SHA-256)."""
    manifest = folder / "manifest.json"
    return hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None


def _size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6


MODEL_ID_TAG = "grpo.model_id"
# the model's code file, named by path: it loads checkpoints and generates (train, rl), which tracking,
# a leaf below them, never imports
POLICY_MODEL_CODE = Path(__file__).resolve().parents[1] / "policy_model.py"


def log_checkpoint(log: MlflowLogger, cfg: Config, stage: str) -> None:
    """Log ``checkpoints/<stage>`` as an MLflow Model of the run, named after the stage (if within the
    size limit; :func:`_log_model`); register the grpo checkpoint's model as a new version of
    ``tracking.registered_model``."""
    folder = Path(CHECKPOINT_DIR) / stage
    sha = checkpoint_sha256(folder)
    if sha is None:
        return
    log.set_tags({CHECKPOINT_TAG: sha})
    size = _size_mb(folder)
    if not 0 < size <= cfg.tracking.log_model_max_mb:
        log.set_tags({"grpo.checkpoint_logged": f"false ({size:.0f} MB > tracking.log_model_max_mb)"})
        return
    log._guard("log_model", WithLogger(_log_model), str(folder.resolve()), stage, sha)
    if stage == "grpo" and cfg.tracking.registered_model:
        log._guard("register_model", WithLogger(_register_uploaded), cfg.tracking.registered_model, sha)


def model_dir(checkpoint: Path, out: Path) -> Path:
    """`out`: an MLflow pyfunc model of `checkpoint` (MLmodel, the model's code file, the
    ``pipeline`` package as its code, the checkpoint as its ``checkpoint`` artifact, pinned
    requirements); nothing is pickled and no environment is inferred."""
    from importlib.metadata import PackageNotFoundError, version

    import mlflow.pyfunc
    import torch
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    import pipeline
    from pipeline.tracking.common import POLICY_MODEL_PARAMS

    reqs = [f"mlflow=={mlflow.__version__}", f"torch=={torch.__version__.split('+')[0]}"]
    for dist in ("safetensors", "tokenizers", "transformers"):
        try:
            reqs.append(f"{dist}=={version(dist)}")
        except PackageNotFoundError:  # an optional package not installed
            continue
    mlflow_type = {bool: "boolean", int: "long", float: "double"}
    signature = ModelSignature(  # prompt strings in, a completion each out; the generation params it takes
        inputs=Schema([ColSpec("string")]), outputs=Schema([ColSpec("string")]),
        params=ParamSchema([ParamSpec(k, mlflow_type[type(v)], v) for k, v in POLICY_MODEL_PARAMS.items()]))
    # MLflow copies the checkpoint into the model behind a progress bar (a line per file once the output is
    # not a terminal, e.g. in the Prefect UI): off unless the user turned it on
    progress = {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")}
    with warnings.catch_warnings(), temporary_env(progress):  # its advice on type hints: the signature is given
        warnings.filterwarnings("ignore", category=UserWarning, module=r"mlflow\.")
        mlflow.pyfunc.save_model(str(out), python_model=str(POLICY_MODEL_CODE),
                                 artifacts={"checkpoint": str(checkpoint)}, signature=signature,
                                 code_paths=[str(Path(pipeline.__file__).parent)], pip_requirements=reqs)
    return out


def _log_model(log: MlflowLogger, folder: str, stage: str, sha: str) -> None:
    """On the logging thread (or in a later run making the calls this one saved): the checkpoint
    as an MLflow Model (a LoggedModel named after the stage, linked to the run as its output, shown
    in the runs list's Models column), its id in the run's ``grpo.model_id`` tag."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus

    client, run = log.client, log.client.get_run(log.run_id)
    model = client.create_logged_model(run.info.experiment_id, name=stage, source_run_id=log.run_id,
                                       tags={CHECKPOINT_TAG: sha})
    try:
        with tempfile.TemporaryDirectory(prefix="grpo-model-") as tmp:
            client.log_model_artifacts(model.model_id, str(model_dir(Path(folder), Path(tmp) / "model")))
    except BaseException:
        client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
        raise
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    client.log_outputs(log.run_id, [LoggedModelOutput(model.model_id, step=0)])
    client.set_tag(log.run_id, MODEL_ID_TAG, model.model_id)


def _register_uploaded(log: MlflowLogger, name: str, sha: str) -> None:
    """Register the run's checkpoint model: on the logging thread, after the upload it depends on (or
    in a later run making the calls this one saved), and only if that upload went through."""
    model_id = log.client.get_run(log.run_id).data.tags.get(MODEL_ID_TAG)
    if "log_model" not in log._broken and model_id:
        _register(log.client, name, log.run_id, sha, model_id)


def _register(client, name: str, run_id: str, sha: str, model_id: str | None = None) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, description="GRPO policy checkpoints (safetensors + JSON) as "
                                                          "pyfunc models: mlflow.pyfunc.load_model, or the "
                                                          "checkpoint artifact with pipeline.train.checkpoint.load_policy")
    except MlflowException as exc:
        if "already exists" not in str(exc).lower() and "RESOURCE_ALREADY_EXISTS" not in str(exc):
            raise
    # the model's own artifact location, not models:/<id>: MLflow's SQL registry resolves that through
    # the process's default tracking URI rather than this client's (and keeps no model id for a plain
    # location, so the version carries it as a tag)
    source = (client.get_logged_model(model_id).artifact_location if model_id
              else client.get_run(run_id).info.artifact_uri.rstrip("/") + "/checkpoint")
    link = {MODEL_ID_TAG: model_id} if model_id else {}
    # the same weights evaluated before (a re-run DVC's evaluate then skips, or restores from its run
    # cache): the new version carries that evaluation too, not an empty row in the registry
    earlier = {k: v for mv in client.search_model_versions(f"name = '{name}'")
               if mv.tags.get(CHECKPOINT_TAG) == sha for k, v in mv.tags.items() if k.startswith("eval.")}
    client.create_model_version(name, source, run_id=run_id, tags={CHECKPOINT_TAG: sha, **link, **earlier})


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
