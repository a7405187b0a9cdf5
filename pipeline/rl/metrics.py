"""What one GRPO iteration reports: its figures over ranks, the worked examples' share, the samples
table and the progress line. Plain arguments (the stage's config section, the sampled
:class:`~pipeline.rl.group_sampling.Groups`, the update's statistics), no stage state.
"""

from __future__ import annotations

from typing import Any

from pipeline.core import distributed as dist_utils
from pipeline.core.config import GRPOConfig
from pipeline.rl.group_sampling import Groups
from pipeline.rl.loss import informative_fraction


def iteration_metrics(conf: GRPOConfig, groups: Groups, stats: dict[str, float], times: dict[str, float],
                      world: int = 1) -> dict[str, Any]:
    """The iteration's figures, averaged (or summed, then divided) over the `world` ranks: the groups'
    reward and informative fraction, the loss statistics of the update (`stats`), response lengths,
    entropy, throughput and the phase times (`times`: perf_counter stamps of `start`, `rollout`'s and
    `scoring`'s durations, `logprobs`, `update`, `end`)."""
    G, ro, rewards, sampled = conf.group_size, groups.rollout, groups.rewards, groups.sampled
    resp_f = ro.response_mask.float()
    lengths = resp_f.sum(1)
    n_tok = float(lengths.sum().item())
    # entropy estimate: mean negative log-prob of the sampled tokens (unbiased at temperature 1)
    entropy = -(ro.logprobs * resp_f).sum().item() / max(n_tok, 1.0)
    local = {
        "reward": rewards.mean().item(), "reward_std": rewards.std().item(),
        "informative": informative_fraction(rewards, G),
        "response_len": lengths.mean().item(), "truncated": ro.truncated.float().mean().item(),
        "entropy": entropy, **stats,
    }
    metrics = dist_utils.mean_across_ranks(local)
    # every group rolled out this iteration, the dropped ones included: the policy's own reward and
    # informative fraction (with dynamic sampling, `reward`/`informative` describe the kept batch only)
    n_groups = sampled.shape[0]
    r_sum, r_n, inf_n, n_groups, dropped = dist_utils.sum_across_ranks([
        sampled.sum().item(), sampled.numel(), informative_fraction(sampled.view(-1), G) * n_groups, n_groups,
        groups.dropped])
    metrics.update({
        "reward_sampled": r_sum / max(r_n, 1.0), "informative_sampled": inf_n / max(n_groups, 1.0),
        "dropped_groups": int(dropped),
        "tokens_per_s": n_tok * world / max(times["end"] - times["start"], 1e-9),
        "time_rollout": times["rollout"], "time_scoring": times["scoring"],
        "time_logprobs": times["update"] - times["logprobs"], "time_update": times["end"] - times["update"],
    })
    names = list(groups.part_sums)  # every rank scores the same task: the same parts in the same order
    sums = dist_utils.sum_across_ranks([x for n in names for x in groups.part_sums[n]])
    metrics.update({f"reward/{n}": sums[2 * i] / sums[2 * i + 1] if sums[2 * i + 1] else None
                    for i, n in enumerate(names)})
    if conf.fewshot_examples:
        metrics.update(scaffold_metrics(groups))
    return metrics


def scaffold_metrics(groups: Groups) -> dict[str, float | None]:
    """Over every completion rolled out (dynamic sampling's dropped groups included), summed over ranks:
    the share sampled after the worked examples, and the mean reward and well-formed `<answer>` rate of
    the bare and of the shown completions (None where there were none)."""
    shown, rewards, formed = groups.sampled_shown.bool(), groups.sampled, groups.sampled_formed  # (groups, G)
    sums = []
    for part in (~shown, shown):
        sums += [float(part.sum()), float(rewards[part].sum()), float(formed[part].sum())]
    n_bare, r_bare, f_bare, n_shown, r_shown, f_shown = dist_utils.sum_across_ranks(sums)

    def mean(total: float, n: float) -> float | None:
        return total / n if n else None

    return {"fewshot_share": n_shown / max(n_bare + n_shown, 1.0),
            "reward_bare": mean(r_bare, n_bare), "well_formed_bare": mean(f_bare, n_bare),
            "reward_shown": mean(r_shown, n_shown), "well_formed_shown": mean(f_shown, n_shown)}


def sample_rows(groups: Groups, G: int) -> list[dict[str, Any]]:
    """The first completion of the first three groups, for the tracker's samples table."""
    ro, rows = groups.rollout, groups.rows
    return [{"prompt": rows[i // G]["question"][:200], "completion": ro.texts[i],
             "reward": groups.rewards[i].item(), "gold": rows[i // G]["gold"]}
            for i in range(0, min(len(ro.texts), 3 * G), G)]


def progress_info(metrics: dict[str, Any], dynamic_sampling: bool) -> str:
    """The policy's reward and informative fraction over every group rolled out; with dynamic
    sampling also the kept batch's (filtered towards informative groups)."""
    kept = f" (kept {metrics['reward']:.3f} / {metrics['informative']:.2f})" if dynamic_sampling else ""
    acc = f"  acc {metrics['accuracy']:.3f}" if metrics.get("accuracy") is not None else ""
    return (f"reward {metrics['reward_sampled']:.3f}  inf {metrics['informative_sampled']:.2f}{kept}"
            f"  kl {metrics['kl']:.4f}{acc}")
