"""What every training stage (SFT and GRPO) shares: the optimiser, LR schedule and non-finite step
policy (``optim``), checkpoints as safetensors + JSON with a verified manifest (``checkpoint``,
``manifest``), and resumable training state (``state``, ``resume``)."""
