"""The RL algorithm: GRPO's loss math (``loss``: group-relative advantages, the k3 KL, the clipped
surrogate), the rollout (``rollout``), which groups an iteration trains on (``group_sampling``), the
completions evaluation scores (``generation``) and the evaluation metrics (``evaluation``). The loop
that ties them together is ``grpo_iteration`` in ``pipeline/stages/grpo.py``."""
