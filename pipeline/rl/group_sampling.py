"""Which groups a GRPO iteration trains on: the prompt order, DAPO dynamic sampling, the verifier.

- ``next_prompts`` / ``next_shard``: seeded epoch-wise permutations of the training rows. The whole
  state is a cursor ``(epoch, pos)``, which the trainer keeps in its resumable state.
- ``sample_groups``: this rank's ``prompts_per_iter / world`` prompts, G completions each
  (group-contiguous), scored by the verifier. With dynamic sampling a zero-variance group (every
  completion scored the same: zero advantages, no policy gradient) is dropped and replaced by a
  fresh prompt, for up to ``max_sampling_rounds`` rollout rounds.
- ``fitting_rows``: the prompts that leave room for the rollout in the model's context.
- ``Scaffold``: `fewshot_examples` worked examples shown before a drawn prompt's question, with a
  share that fades (``scaffold_share``). `prompt` mode: which rows are shown them is a seeded draw per
  iteration and row, so a resumed run shows the same ones and no sampling stream moves. `guide` mode:
  part of every group is sampled after the examples and trained as answers to the bare prompt
  (``guided_rollout``).
- ``level_keep`` / ``count_levels``: the warmup's `level_sampling = informative`: each drawn prompt
  is kept with its curriculum level's chance (its estimated informative-group rate over the best
  level's), so the rollouts go where the verifier's signal is; the skipped rows are passed over in the
  same seeded order, so the cursor alone still says where the stream stands.
- ``PromptSource``: both behind one object the loop asks (``draw`` before sampling, ``observe``
  after); ``worked_examples`` builds a stage's scaffold; ``adapt_curriculum`` lengthens or ends the
  warmup by its reward, accuracy and informative fraction.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.core import distributed as dist_utils
from pipeline.core.config import DataConfig, GRPOConfig, WarmupConfig
from pipeline.core.errors import InputError
from pipeline.data.prompts import fewshot_prompt
from pipeline.data.schema import read_rows
from pipeline.model.policy import Policy
from pipeline.rewards.task_rewards import TaskRewards
from pipeline.rl.loss import informative_groups
from pipeline.rl.rollout import Rollout, left_pad, rollout_prompts

log = logging.getLogger(__name__)

Cursor = tuple[int, int]  # (epoch, position in that epoch's permutation of the rows)


# --------------------------------------------------------------------------- worked-example scaffold

def scaffold_share(iteration: int, fade: int) -> float:
    """The share of prompts shown the worked examples at 0-based `iteration`: 1 at the first, falling
    linearly to 0 at 0-based iteration `fade` (the series' iteration `fade` + 1) and after; `fade` 0: 1
    throughout."""
    return 1.0 if fade == 0 else max(0.0, 1.0 - iteration / fade)


@dataclass(frozen=True)
class Scaffold:
    """The worked-example scaffold of a stage (`<stage>.fewshot_examples` / `fewshot_fade`) at one
    iteration (:meth:`at`)."""

    prompt: Callable[[str], str | None]  # a question -> its prompt after the examples; None: it would not fit
    examples: frozenset[str]  # the examples' own questions: rows asking one of them stay bare (no answer leak)
    fade: int  # `fewshot_fade`
    seed: int
    mode: str = "prompt"  # `fewshot_mode`
    iteration: int = 0  # 0-based

    @property
    def share(self) -> float:
        """Each drawn row's chance of being shown the examples at this iteration."""
        return scaffold_share(self.iteration, self.fade)

    def at(self, iteration: int) -> Scaffold:
        return dataclasses.replace(self, iteration=iteration)

    def guided(self, group_size: int) -> int:
        """`guide` mode: how many of a group's completions are sampled after the examples (half the
        group at share 1, rounded half up)."""
        return int(self.share * group_size / 2 + 0.5)

    def prompt_for(self, index: int, row: dict[str, Any]) -> str | None:
        """The scaffolded prompt of the row at position `index` of the training rows, or None where it
        stays bare: a seeded draw per (seed, iteration, position), independent of every other random
        stream, so a resumed run shows the same rows the examples."""
        share = self.share
        if share <= 0.0 or row["question"] in self.examples:
            return None
        if self.mode == "prompt" and share < 1.0 and random.Random(f"fewshot:{self.seed}:{self.iteration}:{index}").random() >= share:
            return None
        return self.prompt(row["question"])


# --------------------------------------------------------------------------- prompt order

def _permutation(n: int, seed: int, epoch: int, uniforms: bool = False) -> tuple[list[int], list[float]]:
    """An epoch's seeded order of range(n) and, with `uniforms`, one U(0, 1) draw per position (from
    the same generator after the permutation, so the order is the same either way)."""
    gen = torch.Generator().manual_seed(seed * 7919 + epoch)
    order = torch.randperm(n, generator=gen).tolist()
    return order, (torch.rand(n, generator=gen, dtype=torch.float64).tolist() if uniforms else [])


def next_prompts(n: int, seed: int, cursor: Cursor, k: int,
                 keep: list[float] | None = None) -> tuple[list[int], Cursor]:
    """The next `k` row indices of seeded epoch-wise permutations of range(n), and the new cursor.

    With `keep` (a chance in (0, 1] per row), the row at each position is taken only if that
    position's seeded uniform draw is below its chance, and passed over otherwise: a thinned stream,
    as reproducible from the cursor as the plain one (which `keep` = None gives, bit for bit)."""
    epoch, pos = cursor
    order, u = _permutation(n, seed, epoch, keep is not None)
    out: list[int] = []
    while len(out) < k:
        if pos >= n:
            epoch, pos = epoch + 1, 0
            order, u = _permutation(n, seed, epoch, keep is not None)
        if keep is None:
            take = min(k - len(out), n - pos)
            out += order[pos:pos + take]
            pos += take
        else:
            if u[pos] < keep[order[pos]]:
                out.append(order[pos])
            pos += 1
    return out, (epoch, pos)


def next_shard(n: int, seed: int, cursor: Cursor, need: int, need_max: int, rank: int,
               world: int, keep: list[float] | None = None) -> tuple[list[int], Cursor]:
    """This rank's `need` fresh indices when every rank draws in the same round.

    Every rank advances the cursor by the same `need_max * world` indices (`need_max`: the largest
    `need` over ranks), and rank r takes from its own block of `need_max`, so the cursors stay in
    step and no two ranks get the same prompt, even when dynamic sampling makes ranks top up
    different numbers of groups. One process: the same as `next_prompts(n, seed, cursor, need)`.
    """
    drawn, cursor = next_prompts(n, seed, cursor, need_max * world, keep)
    return drawn[rank * need_max:rank * need_max + need], cursor


# --------------------------------------------------------------------------- groups

@dataclass
class Groups:
    """One iteration's training batch on this rank (see `sample_groups`)."""

    rows: list[dict[str, Any]]  # the kept prompts' rows
    rollout: Rollout  # their G completions each, group-contiguous
    rewards: torch.Tensor  # (len(rows) * G,) verifier rewards of the rollout's rows
    sampled: torch.Tensor  # (groups, G) rewards of every group rolled out, the dropped ones included
    sampled_idx: list[int]  # the row index of each of those groups, in `sampled`'s order
    dropped: int  # groups dropped for zero variance
    cursor: Cursor  # the prompt cursor after this iteration's draws
    times: dict[str, float]  # seconds in rollout and scoring
    # with a scaffold, per completion of every group rolled out (the dropped ones included, in `sampled`'s
    # order), (groups, G): sampled after the worked examples, and a well-formed `<answer>`; empty without one
    sampled_shown: torch.Tensor
    sampled_formed: torch.Tensor
    off_policy: bool  # some completions were sampled after another prompt than the one they are trained on
    # each reward part over every completion rolled out: name -> [sum of its values, how many were not None]
    part_sums: dict[str, list[float]] = dataclasses.field(default_factory=dict)


def score(rows: list[dict[str, Any]], texts: list[str], group_size: int, rewards: TaskRewards,
          part_sums: dict[str, list[float]] | None = None) -> torch.Tensor:
    """The task's rewards (N,) of group-contiguous completions (completion i answers rows[i // G], after
    its bare prompt); each part's values are added to `part_sums`."""
    per = [rows[i // group_size] for i in range(len(texts))]
    total, parts = rewards.score([r["prompt"] for r in per], texts, per)
    if part_sums is not None:
        for name, values in parts.items():
            acc = part_sums.setdefault(name, [0.0, 0.0])
            acc[0] += sum(v for v in values if v is not None)
            acc[1] += sum(v is not None for v in values)
    return torch.tensor(total)


def sample_groups(policy: Policy, rows: list[dict[str, Any]], cursor: Cursor, conf: GRPOConfig, rewards: TaskRewards,
                  generator: torch.Generator, rank: int = 0, world: int = 1,
                  keep: list[float] | None = None, scaffold: Scaffold | None = None) -> Groups:
    """Roll out and score this rank's groups; with dynamic sampling, replace zero-variance groups.
    `keep`: each row's chance of being kept when drawn (:func:`next_prompts`); None: every row.
    `scaffold`: worked examples shown before some prompts; None: every prompt bare."""
    G, per_rank = conf.group_size, conf.prompts_per_iter // world
    kept_rows: list[dict[str, Any]] = []
    shown: list[torch.Tensor] = []
    formed: list[torch.Tensor] = []
    kept: list[tuple[Rollout, list[int]]] = []
    kept_rewards: list[torch.Tensor] = []
    sampled: list[torch.Tensor] = []
    sampled_idx: list[int] = []
    dropped, rounds, times = 0, 0, {"rollout": 0.0, "scoring": 0.0}
    part_sums: dict[str, list[float]] = {}
    while rounds < conf.max_sampling_rounds:
        need = per_rank - len(kept_rows)
        # all ranks draw together (same cursor, disjoint prompts) until none needs more
        need_max = dist_utils.max_across_ranks(need)
        if need_max == 0:
            break
        idx, cursor = next_shard(len(rows), conf.seed, cursor, need, need_max, rank, world, keep)
        rounds += 1
        if not idx:  # this rank is full; it still drew so that its cursor stays in step
            continue
        batch = [rows[i] for i in idx]
        scaffolded = [scaffold.prompt_for(i, rows[i]) if scaffold else None for i in idx]
        t0 = time.perf_counter()
        if scaffold and scaffold.mode == "guide":
            ro, guided = guided_rollout(policy, batch, scaffolded, scaffold.guided(G), conf, generator)
        else:
            ro = rollout_prompts(policy, [s or r["prompt"] for r, s in zip(batch, scaffolded)], G, conf.rollout_len,
                                 conf.temperature, conf.top_p, conf.top_k, generator=generator)
            guided = torch.tensor([s is not None for s in scaffolded]).view(-1, 1).expand(-1, G)
        t1 = time.perf_counter()
        group_rewards = score(batch, ro.texts, G, rewards, part_sums).view(-1, G)  # (prompts, G)
        times["rollout"] += t1 - t0
        times["scoring"] += time.perf_counter() - t1
        sampled.append(group_rewards)
        sampled_idx += idx
        if scaffold:
            shown.append(guided)
            formed.append(torch.tensor([rewards.checker.well_formed(t) for t in ro.texts], dtype=torch.float).view(-1, G))
        informative = informative_groups(group_rewards, G)
        for j, row in enumerate(batch):
            # a zero-variance group has zero advantages: it carries no policy gradient (DAPO drops it)
            if conf.dynamic_sampling and not informative[j] and rounds < conf.max_sampling_rounds:
                dropped += 1
                continue
            kept_rows.append(row)
            kept.append((ro, list(range(j * G, (j + 1) * G))))
            kept_rewards.append(group_rewards[j])
        if not conf.dynamic_sampling:
            break
    rollout = select_rollouts(kept[:per_rank], policy.tokenizer.pad_id)
    return Groups(kept_rows[:per_rank], rollout, torch.cat(kept_rewards[:per_rank]), torch.cat(sampled), sampled_idx,
                  dropped, cursor, times, torch.cat(shown) if shown else torch.empty(0, G, dtype=torch.bool),
                  torch.cat(formed) if formed else torch.empty(0, G),
                  bool(scaffold and scaffold.mode == "guide" and any(bool(g.any()) for g in shown)), part_sums)


def guided_rollout(policy: Policy, batch: list[dict[str, Any]], scaffolded: list[str | None], k: int,
                   conf: GRPOConfig, generator: torch.Generator) -> tuple[Rollout, torch.Tensor]:
    """`guide` mode: G completions of each row, the first `k` sampled after the worked examples
    (`scaffolded`; None: that row gets none), the rest after the bare prompt; all of them as answers to
    the bare prompt (its token ids before every response). Returns the group-contiguous rollout and
    which completions were guided (rows, G)."""
    G, tok = conf.group_size, policy.tokenizer
    with_k = [j for j, s in enumerate(scaffolded) if s is not None and k > 0]
    plain = [j for j in range(len(batch)) if j not in set(with_k)]

    def sample(prompts: list[str], n: int) -> Rollout | None:
        if not prompts:
            return None
        return rollout_prompts(policy, prompts, n, conf.rollout_len, conf.temperature, conf.top_p, conf.top_k,
                               generator=generator)

    guided = sample([scaffolded[j] for j in with_k], k)
    bare_rest = sample([batch[j]["prompt"] for j in with_k], G - k)
    bare_all = sample([batch[j]["prompt"] for j in plain], G)
    if guided is not None:  # the guided responses after the bare prompts they are trained on
        guided = with_prompts(guided, [tok.encode(batch[j]["prompt"]) for j in with_k for _ in range(k)], tok.pad_id)
    parts: list[tuple[Rollout, list[int]]] = []
    where_k, where_plain = {j: n for n, j in enumerate(with_k)}, {j: n for n, j in enumerate(plain)}
    for j in range(len(batch)):
        if j in where_k:
            n = where_k[j]
            parts += [(guided, list(range(n * k, (n + 1) * k))), (bare_rest, list(range(n * (G - k), (n + 1) * (G - k))))]
        else:
            n = where_plain[j]
            parts.append((bare_all, list(range(n * G, (n + 1) * G))))
    mask = torch.zeros(len(batch), G, dtype=torch.bool)
    mask[with_k, :k] = True
    return select_rollouts(parts, tok.pad_id), mask


def with_prompts(ro: Rollout, prompt_ids: list[list[int]], pad_id: int) -> Rollout:
    """`ro`'s responses after other prompts (token ids, one list per row), left-padded afresh."""
    ids, mask = left_pad(prompt_ids, pad_id, ro.input_ids.device)
    P, resp = ids.shape[1], slice(ro.prompt_len, None)
    zeros = torch.zeros(ids.shape, dtype=ro.response_mask.dtype, device=ids.device)
    return Rollout(input_ids=torch.cat([ids, ro.input_ids[:, resp]], 1),
                   attention_mask=torch.cat([mask.to(ro.attention_mask.dtype), ro.attention_mask[:, resp]], 1),
                   response_mask=torch.cat([zeros, ro.response_mask[:, resp]], 1),
                   logprobs=torch.cat([torch.zeros(ids.shape, dtype=ro.logprobs.dtype, device=ids.device),
                                       ro.logprobs[:, resp]], 1),
                   texts=ro.texts, response_lengths=ro.response_lengths, truncated=ro.truncated, prompt_len=P)


def select_rollouts(parts: list[tuple[Rollout, list[int]]], pad_id: int) -> Rollout:
    """Concatenate chosen rows of several rollouts, re-padding prompts (left) and responses (right).

    Extra left padding does not change log-probs: positions come from the attention mask.
    """
    if len({id(ro) for ro, _ in parts}) == 1:
        ro, _ = parts[0]
        idx = torch.tensor([i for _, rows in parts for i in rows])
        if idx.numel() == ro.input_ids.shape[0] and torch.equal(idx, torch.arange(idx.numel())):
            return ro
    P = max(ro.prompt_len for ro, _ in parts)
    R = max(ro.input_ids.shape[1] - ro.prompt_len for ro, _ in parts)
    fields: dict[str, list] = {k: [] for k in ("input_ids", "attention_mask", "response_mask", "logprobs")}
    texts, lengths, trunc = [], [], []
    for ro, rows in parts:
        idx = torch.tensor(rows)
        left, right = P - ro.prompt_len, R - (ro.input_ids.shape[1] - ro.prompt_len)
        for name in fields:
            t = getattr(ro, name)[idx]
            fill = pad_id if name == "input_ids" else 0
            fields[name].append(torch.nn.functional.pad(t, (left, right), value=fill))
        texts += [ro.texts[i] for i in rows]
        lengths.append(ro.response_lengths[idx])
        trunc.append(ro.truncated[idx])
    return Rollout(**{k: torch.cat(v) for k, v in fields.items()}, texts=texts,
                   response_lengths=torch.cat(lengths), truncated=torch.cat(trunc), prompt_len=P)


def fitting_rows(rows: list[dict[str, Any]], policy: Policy, rollout_len: int, path: Path,
                 stage: str) -> list[dict[str, Any]]:
    """Rows whose prompt leaves room for `rollout_len` new tokens in the model's context."""
    limit = policy.max_len
    if limit is None:
        return rows
    budget = limit - rollout_len
    kept = [r for r in rows if len(policy.tokenizer.encode(r["prompt"])) <= budget]
    if len(kept) < len(rows):
        log.info("%s: %d of %d prompts in %s leave no room for %s.rollout_len = %d tokens in the %d-token "
                 "context; skipped", stage, len(rows) - len(kept), len(rows), path, stage, rollout_len, limit)
    if not kept:
        raise InputError(f"{path}: no prompt fits model.block_size = {limit} with {stage}.rollout_len = "
                         f"{rollout_len}; raise model.block_size or lower the rollout length")
    return kept


# --------------------------------------------------------------------------- levels (warmup.level_sampling)

LEVEL_DECAY = 0.9  # per iteration: the counts, and so the rates, follow the policy as it learns


def row_levels(rows: list[dict[str, Any]], path: Path, key: str) -> list[int]:
    """Each row's curriculum `level` (an integer); InputError naming the file and the row's `id` (which
    every prepared row has, and which finds it whatever rows were skipped) where one is missing."""
    out = []
    for row in rows:
        level = row.get("level")
        if not isinstance(level, int) or isinstance(level, bool):
            raise InputError(f"{path}: row id {row.get('id')!r} has level = {level!r}, not an integer ({key} = "
                             f"informative draws prompts by curriculum level); allowed: rows that all carry an "
                             f"integer `level`, or {key} = uniform")
        out.append(level)
    return out


def level_rates(counts: dict[str, list[float]]) -> dict[str, float]:
    """Each level's estimated chance that a group is informative: (informative + 1) / (groups + 2) of its
    decayed counts (``[groups, informative]``), 1/2 for a level not yet seen."""
    return {level: (inf + 1.0) / (n + 2.0) for level, (n, inf) in counts.items()}


def level_keep(counts: dict[str, list[float]], levels: list[int], floor: float) -> tuple[list[float], dict[str, float]]:
    """Each row's chance of being kept when drawn (its level's rate over the best level's rate, at least
    `floor`), and that chance per level. `counts` holds every level of `levels`."""
    rates = level_rates(counts)
    top = max(rates.values())
    chance = {level: max(rate / top, floor) for level, rate in rates.items()}
    return [chance[str(level)] for level in levels], chance


def count_levels(counts: dict[str, list[float]], levels: list[int], sampled_idx: list[int],
                 sampled: torch.Tensor) -> dict[str, list[float]]:
    """The counts after one iteration: every level's decayed by :data:`LEVEL_DECAY`, then this
    iteration's groups added (all ranks' where `counts` is the same on every rank: the sums are taken
    across ranks, so the chances stay equal and the ranks' cursors in step)."""
    names = sorted(counts, key=int)
    informative = informative_groups(sampled, sampled.shape[1]).tolist()
    local = {name: [0.0, 0.0] for name in names}
    for i, inf in zip(sampled_idx, informative):
        local[str(levels[i])][0] += 1.0
        local[str(levels[i])][1] += float(inf)
    summed = dist_utils.sum_across_ranks([x for name in names for x in local[name]])
    return {name: [LEVEL_DECAY * counts[name][0] + summed[2 * j], LEVEL_DECAY * counts[name][1] + summed[2 * j + 1]]
            for j, name in enumerate(names)}


@dataclass
class PromptSource:
    """Which prompts an iteration draws and how they are asked: the curriculum's levels, weighted by how
    informative each has been (``warmup.level_sampling: informative``; None: uniform), and the
    worked-examples scaffold (``<stage>.fewshot_examples``; None: bare prompts). What it learns lives
    in the stage's resumable state (``level_counts``), so a resumed run draws as an unbroken one."""

    levels: list[int] | None = None  # each training row's curriculum level
    scaffold: Scaffold | None = None
    floor: float = 0.0  # the least chance a level's prompt is kept

    def draw(self, state: Any) -> tuple[list[float] | None, dict[str, float], Scaffold | None]:
        """(each row's chance of being kept when drawn, that chance per level, the scaffold at this
        iteration) for `state` (with ``level_counts`` and ``iteration``)."""
        scaffold = self.scaffold.at(state.iteration) if self.scaffold else None
        if self.levels is None:
            return None, {}, scaffold
        state.level_counts = state.level_counts or {str(v): [0.0, 0.0] for v in sorted(set(self.levels))}
        return *level_keep(state.level_counts, self.levels, self.floor), scaffold

    def observe(self, state: Any, groups: Groups, chance: dict[str, float]) -> dict[str, float]:
        """Count this iteration's groups into `state.level_counts`; the tracker's view of level sampling:
        each level's chance this iteration drew with, and its informative rate after these groups."""
        if self.levels is None:
            return {}
        state.level_counts = count_levels(state.level_counts, self.levels, groups.sampled_idx, groups.sampled)
        return {**{f"level_keep/{v}": c for v, c in chance.items()},
                **{f"level_informative/{v}": r for v, r in level_rates(state.level_counts).items()}}


def worked_examples(policy: Policy, path: Path, data: DataConfig, conf: GRPOConfig, stage: str,
                    template: str | None = None) -> Scaffold:
    """`<stage>.fewshot_examples`: the first N rows of the training file `path` as worked examples (where
    evaluate's few-shot entries take theirs from) and the prompt of a question after them. A prompt that
    leaves no room for the rollout in the model's context stays bare (logged once); an InputError where
    the examples alone leave none."""
    shots = [(r["question"], r["solution"]) for r in read_rows(path, conf.fewshot_examples)]
    limit = policy.max_len
    budget = None if limit is None else limit - conf.rollout_len
    told = False

    def prompt(question: str) -> str | None:
        nonlocal told
        text = fewshot_prompt(question, shots, policy.tokenizer, data, template)
        if budget is None or len(policy.tokenizer.encode(text)) <= budget:
            return text
        if not told:
            log.warning("%s: with %s.fewshot_examples = %d worked examples some prompts leave no room for "
                        "%s.rollout_len = %d tokens in the %d-token context; those stay bare", stage, stage,
                        conf.fewshot_examples, stage, conf.rollout_len, limit)
            told = True
        return None

    alone = len(policy.tokenizer.encode(fewshot_prompt("", shots, policy.tokenizer, data, template)))
    if budget is not None and alone > budget:
        raise InputError(f"{stage}.fewshot_examples = {conf.fewshot_examples}: the worked examples of {path} alone "
                         f"take {alone} tokens, more than the {budget} a prompt may have with {stage}.rollout_len = "
                         f"{conf.rollout_len} in model.block_size = {limit}; allowed: fewer examples, a shorter "
                         f"rollout or a longer context")
    return Scaffold(prompt, frozenset(q for q, _ in shots), conf.fewshot_fade, conf.seed, conf.fewshot_mode)


def adapt_curriculum(conf: GRPOConfig, state: Any, metrics: dict[str, Any]) -> None:
    """Adaptive curriculum (warmup only): leave early, or stay longer while groups are uninformative.
    Moves `state.total_iters` (the stage's resumable state; `iteration` done) and logs the decision in
    `state.adaptive_log`."""
    if not isinstance(conf, WarmupConfig) or not conf.adaptive:
        return
    acc, it = metrics.get("accuracy"), state.iteration
    decision = None
    # not while worked examples are shown: their groups' reward is not the bare prompt's
    if (acc is not None and metrics["reward"] >= conf.exit_reward and acc >= conf.exit_accuracy
            and not metrics.get("fewshot_share")):
        if it < state.total_iters:
            decision = (f"iteration {it}: reward {metrics['reward']:.3f} and accuracy {acc:.3f} "
                        f"passed the thresholds; leaving the warmup early")
            state.total_iters = it
    elif (it == state.total_iters and metrics["informative"] < conf.min_informative
          and state.total_iters < conf.iterations + conf.max_extra_iters):
        state.total_iters += 1
        decision = (f"iteration {it}: informative {metrics['informative']:.2f} < {conf.min_informative}; "
                    f"extending the warmup by one iteration")
    if decision:
        state.adaptive_log.append(decision)
        log.info("warmup: %s", decision)
