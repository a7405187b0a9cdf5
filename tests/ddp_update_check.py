"""Helper for tests/test_train.py: one GRPO update on a fixed batch, single process or under torchrun.

Usage: python tests/ddp_update_check.py OUT.safetensors [MINIBATCH_GROUPS]         (1 process)
       torchrun --nproc_per_node=2 tests/ddp_update_check.py OUT [MINIBATCH_GROUPS] [ddp|fsdp] [HF_FOLDER]
       (each rank: half the groups; ddp replicates the model, fsdp shards it: pipeline.train.fsdp; the
       policy is a tiny GPT, or the transformers model saved in HF_FOLDER)
Writes the updated weights and the reduced stats (OUT with .json) from rank 0. The groups are dealt
to the ranks in turn (rank r: groups r, r + world, ...), so that with minibatches each optimizer
step covers the same groups in both runs.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline.core import distributed as du
from pipeline.core.config import GRPOConfig, ModelConfig
from pipeline.data.tokenizer import train_tokenizer
from pipeline.model.policy import build_policy
from pipeline.rl.update import Batch, update
from pipeline.train.optim import step_if_finite
from pipeline.train import fsdp
from pipeline.train.optim import build_optimizer


def main(out: str, minibatch_groups: int = 0, parallel: str = "ddp", hf_folder: str = "") -> None:
    rank, world = du.rank(), du.world_size()
    tok = train_tokenizer([f"{a} + {b} = <answer>{a + b}</answer>" for a in range(30) for b in range(10)], 300)
    torch.manual_seed(0)
    if hf_folder:
        policy = build_policy(ModelConfig(backend="hf", init=hf_folder, device="cpu"))
        tok = policy.tokenizer
    else:
        policy = build_policy(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, device="cpu"), tok)
    sharded = None
    if world > 1 and parallel == "fsdp":
        sharded = fsdp.Sharded(policy)  # the policy sharded in place, and its whole-weight sampler
    elif world > 1:
        policy.runner = du.wrap_ddp(policy.module)
    g = torch.Generator().manual_seed(1)
    N, T = 8, 12
    ids = torch.randint(4, tok.vocab_size, (N, T), generator=g)
    attn = torch.ones(N, T, dtype=torch.long)
    attn[1::2, :2] = 0                                        # left padding on odd rows
    resp = torch.zeros(N, T, dtype=torch.long)
    resp[:, 6:] = 1
    resp[::3, 10:] = 0                                        # early stops -> unequal token counts
    adv = torch.randn(N, generator=g)
    ref_lp = -2.0 + 0.1 * torch.randn(N, T, generator=g)

    g = GRPOConfig(group_size=2, prompts_per_iter=4, lr=1e-2, kl_coef=0.04, minibatch_groups=minibatch_groups)
    optimizer = build_optimizer(policy.module, g.lr, 0.0)
    rows = torch.arange(N).view(-1, g.group_size)[rank::world].reshape(-1)  # this rank's groups, in turn
    batch = Batch(ids[rows], attn[rows], resp[rows], adv[rows], None, ref_lp[rows])
    stats = update(policy, optimizer, g, batch,
                   lambda loss: step_if_finite(optimizer, policy.module.parameters(), g.grad_clip, loss))
    stats = du.mean_across_ranks(stats)
    if sharded is not None:  # what the rollouts and checkpoints read: the sampler, refreshed from the shards
        sharded.stepped()
        weights = sharded.refresh().module.state_dict()
    else:
        weights = policy.module.state_dict()
    if rank == 0:
        save_file({k: v.contiguous().clone() for k, v in weights.items()}, out)
        Path(out).with_suffix(".json").write_text(json.dumps(stats))
    du.barrier()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0, sys.argv[3] if len(sys.argv) > 3 else "ddp",
         sys.argv[4] if len(sys.argv) > 4 else "")
