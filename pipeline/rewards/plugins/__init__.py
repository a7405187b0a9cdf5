"""Users' verifiers (``grpo.reward`` / ``warmup.reward`` / ``evaluate.reward`` = ``module:function``).

A module here is a DVC dependency of every stage that scores (``pipeline/rewards`` in ``dvc.yaml``),
so editing it re-runs them. See :mod:`pipeline.rewards.verifiers` for the checks a plug-in passes.
"""
