"""The RL algorithm: GRPO's loss math (``loss``: group-relative advantages, the k3 KL, the clipped
surrogate), the rollout (``rollout``), which groups an iteration trains on (``group_sampling``), the
update on them (``update``: log-probs, micro-batched gradients, optimizer steps), what an iteration
reports (``metrics``), the completions evaluation scores (``generation``) and the evaluation metrics
(``evaluation``). The loop that ties them together is ``grpo_iteration`` in ``pipeline/stages/grpo.py``."""
