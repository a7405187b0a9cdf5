"""A pipeline checkpoint as an MLflow pyfunc model (models from code: MLflow runs this file to build
the model; no pickle is written or loaded).

Each training stage logs its checkpoint as an MLflow Model of the stage's run
(:func:`pipeline.tracking.mlflow_models.log_checkpoint`): this file, the checkpoint folder as the
model's ``checkpoint`` artifact (safetensors + JSON, verified against its manifest when loaded) and
the ``pipeline`` package as the model's code. Loaded anywhere with ``mlflow.pyfunc.load_model``::

    model = mlflow.pyfunc.load_model("models:/grpo-policy/1")  # or runs:/..., models:/<model_id>
    model.predict(["What is 2 + 3?\\nGive the final answer as <answer>N</answer>."],
                  params={"max_new_tokens": 64})

Loading runs Python: MLflow imports this file and the ``pipeline`` package stored with the model
(models from code, by design), so load only models you trust, as you would run their code. The weights
alone, without running stored code: the ``checkpoint`` artifact is a pipeline checkpoint, read with
``pipeline.train.checkpoint.load_policy(folder)``, which verifies its manifest and reads safetensors
and JSON only. This file lives at the package's top, above ``tracking``, which names it by path.

Input: a list of prompt strings, or a DataFrame with a ``prompt`` column (the text the model sees:
already in its chat template where the run used one, as the pipeline's data files hold it).
Output: one completion per prompt, greedy unless ``params={"greedy": False, "temperature": ...,
"seed": ...}``; on the CPU unless loaded with ``model_config={"device": "cuda"}``.
"""

from __future__ import annotations

from typing import Any

import mlflow
from mlflow.pyfunc import PythonModel

from pipeline.tracking.common import POLICY_MODEL_PARAMS as DEFAULTS


def prompts_of(model_input: Any) -> list[str]:
    """The prompts of a pyfunc input: a string, a list of strings, or a DataFrame's ``prompt`` column
    (its only column if it has one); anything else is refused in one line."""
    if isinstance(model_input, str):
        return [model_input]
    if hasattr(model_input, "columns"):
        cols = list(model_input.columns)
        col = "prompt" if "prompt" in cols else cols[0] if len(cols) == 1 else None
        if col is None:
            raise ValueError(f"expected a 'prompt' column, got columns {cols}")
        model_input = model_input[col].tolist()
    if isinstance(model_input, (list, tuple)) and all(isinstance(p, str) for p in model_input):
        return list(model_input)
    raise ValueError(f"expected prompt strings, a list of them or a DataFrame with a 'prompt' column, "
                     f"got {type(model_input).__name__}")


class PolicyModel(PythonModel):
    """Completions from a pipeline checkpoint (either backend: the from-scratch GPT or an HF model)."""

    # MLflow checks `predict`'s type hints when a subclass is defined, wherever this file runs (saving,
    # loading), and without them prints advice in raw colour codes into every stage's log. The model's
    # signature is given instead (`mlflow_models.model_dir`): a type hint would make MLflow convert and
    # validate the input itself, and this model takes a string, a list of them or a DataFrame
    # (`prompts_of`). The attribute is MLflow's own opt-out (its ChatModel subclasses set it).
    _skip_type_hint_validation = True

    def load_context(self, context) -> None:
        from pipeline.train.checkpoint import load_policy

        config = getattr(context, "model_config", None) or {}
        self.policy = load_policy(context.artifacts["checkpoint"], device=config.get("device", "cpu")).eval()

    def predict(self, context, model_input, params: dict[str, Any] | None = None) -> list[str]:
        import torch

        from pipeline.rl.generation import generate

        p = {**DEFAULTS, **(params or {})}
        prompts = prompts_of(model_input)
        generator = None
        if not p["greedy"]:
            generator = torch.Generator(device=self.policy.device).manual_seed(int(p["seed"]))
        texts, _, _ = generate(self.policy, prompts, batch_size=int(p["batch_size"]),
                               max_new_tokens=int(p["max_new_tokens"]), greedy=bool(p["greedy"]),
                               temperature=float(p["temperature"]), top_p=float(p["top_p"]), generator=generator)
        return texts


mlflow.models.set_model(PolicyModel())
