"""The warmup's `level_sampling = informative`: prompts drawn by curriculum level, each level kept with
its estimated chance of an informative group. The thinned prompt stream against a plain reference
loop, the chances and counts hand-computed, the stage's draw moving to the informative level, a
bit-exact resume of the counts, and bad rows refused with the file and row named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.errors import InputError
from pipeline.rl.group_sampling import (LEVEL_DECAY, count_levels, level_keep, level_rates, next_prompts, next_shard,
                                     row_levels)
from tests.conftest import reward_of, smoke_cfg, weights


@pytest.fixture
def workdir(grpo_workdir):
    return grpo_workdir


# --------------------------------------------------------------------------- the thinned stream

def _reference_draw(n: int, seed: int, cursor: tuple[int, int], k: int, keep: list[float]) -> list[int]:
    """The definition, written out: walk the seeded epoch permutations position by position; a
    position's row is taken when that position's uniform draw (the same generator, after the
    permutation) is below the row's chance."""
    epoch, pos = cursor
    out = []
    while len(out) < k:
        gen = torch.Generator().manual_seed(seed * 7919 + epoch)
        order = torch.randperm(n, generator=gen)
        u = torch.rand(n, generator=gen, dtype=torch.float64)
        for p in range(pos, n):
            if len(out) == k:
                break
            if u[p].item() < keep[order[p].item()]:
                out.append(order[p].item())
        epoch, pos = epoch + 1, 0
    return out


@settings(max_examples=80, deadline=None)
@given(n=st.integers(3, 30), seed=st.integers(0, 500), start=st.integers(0, 29),
       chunks=st.lists(st.integers(0, 12), min_size=1, max_size=5), data=st.data())
def test_the_thinned_stream_is_the_reference_walk_and_resumes_from_its_cursor(n, seed, start, chunks, data):
    keep = data.draw(st.lists(st.floats(0.05, 1.0), min_size=n, max_size=n))
    cursor = (0, start % n)
    got, c = [], cursor
    for k in chunks:  # drawn in pieces, each from the cursor the last left: the same stream as one draw
        part, c = next_prompts(n, seed, c, k, keep)
        assert len(part) == k
        got += part
    assert got == _reference_draw(n, seed, cursor, sum(chunks), keep)
    whole, c_whole = next_prompts(n, seed, cursor, sum(chunks), keep)
    assert whole == got and c_whole == c


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 40), seed=st.integers(0, 500), k=st.integers(0, 90))
def test_every_chance_one_is_the_plain_stream(n, seed, k):
    plain, c_plain = next_prompts(n, seed, (0, 0), k)
    kept, c_kept = next_prompts(n, seed, (0, 0), k, [1.0] * n)
    assert kept == plain and c_kept == c_plain
    assert next_shard(n, seed, (0, 0), k, k, 0, 1, [1.0] * n) == (plain, c_plain)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(5, 40), world=st.integers(2, 4), seed=st.integers(0, 1000), data=st.data(),
       rounds=st.lists(st.lists(st.integers(0, 6), min_size=4, max_size=4), min_size=1, max_size=5))
def test_ranks_draw_the_thinned_stream_in_step_and_never_share_a_prompt(n, world, seed, data, rounds):
    """Under DDP every rank holds the same chances (the counts are summed across ranks), so the ranks'
    cursors stay in step on the thinned stream as on the plain one, each rank takes its own block of a
    round's draw, and no two ranks get the same prompt within an epoch."""
    keep = data.draw(st.lists(st.floats(0.05, 1.0), min_size=n, max_size=n))
    cursors = [(0, 0)] * world
    for needs in rounds:
        needs = needs[:world]
        need_max = max(needs)
        start = cursors[0]
        drawn = [next_shard(n, seed, cursors[r], needs[r], need_max, r, world, keep) for r in range(world)]
        shards, cursors = [d[0] for d in drawn], [d[1] for d in drawn]
        assert [len(x) for x in shards] == needs and len(set(cursors)) == 1
        whole, _ = next_prompts(n, seed, start, need_max * world, keep)
        assert shards == [whole[r * need_max:r * need_max + needs[r]] for r in range(world)]
        if cursors[0][0] == start[0]:  # the round stayed inside one epoch: all distinct
            flat = [i for x in shards for i in x]
            assert len(flat) == len(set(flat))


def test_a_level_is_drawn_at_its_chance():
    """20,000 rows, two levels alternating, level 1 kept with chance 0.2: of 2,000 drawn prompts about
    1/6 are level 1 (0.2 / (0.2 + 1)), and the cursor passed over the skipped rows."""
    n = 20_000
    levels = [1 + i % 2 for i in range(n)]
    keep = [0.2 if lv == 1 else 1.0 for lv in levels]
    drawn, (epoch, pos) = next_prompts(n, 3, (0, 0), 2000, keep)
    share = sum(levels[i] == 1 for i in drawn) / len(drawn)
    assert abs(share - 1 / 6) < 0.03, share
    assert epoch == 0 and 3150 < pos < 3550  # ~2,000 / 0.6 positions walked


# --------------------------------------------------------------------------- chances and counts

def test_chances_are_each_levels_rate_over_the_best_with_a_floor():
    counts = {"1": [10.0, 0.0], "2": [10.0, 4.0], "3": [0.0, 0.0]}
    assert level_rates(counts) == pytest.approx({"1": 1 / 12, "2": 5 / 12, "3": 1 / 2})
    per_row, chance = level_keep(counts, [3, 1, 2, 1], floor=0.2)
    assert chance == pytest.approx({"1": 0.2, "2": 5 / 6, "3": 1.0})  # 1/6 lifted to the floor
    assert per_row == pytest.approx([1.0, 0.2, 5 / 6, 0.2])
    _, fresh = level_keep({"1": [0.0, 0.0], "2": [0.0, 0.0]}, [1, 2], floor=0.1)
    assert fresh == {"1": 1.0, "2": 1.0}  # nothing measured yet: the stream's own mix


def test_counts_decay_then_add_this_iterations_groups():
    levels = [1, 2, 2, 1, 2]  # row -> level
    counts = {"1": [10.0, 2.0], "2": [4.0, 4.0]}
    sampled = torch.tensor([[1.0, 1.0, 1.0],   # row 0, level 1: all the same -> not informative
                            [0.0, 1.2, 1.0],   # row 2, level 2: informative
                            [0.2, 0.2, 0.2],   # row 4, level 2: not
                            [1.0, 0.0, 0.0]])  # row 3, level 1: informative
    out = count_levels(counts, levels, [0, 2, 4, 3], sampled)
    d = LEVEL_DECAY
    assert out.keys() == {"1", "2"}
    assert out["1"] == pytest.approx([10 * d + 2, 2 * d + 1]) and out["2"] == pytest.approx([4 * d + 2, 4 * d + 1])
    empty = count_levels(counts, levels, [], torch.empty(0, 3))
    assert empty["1"] == pytest.approx([10 * d, 2 * d]) and empty["2"] == pytest.approx([4 * d, 4 * d])


def test_counts_are_summed_across_ranks_so_every_rank_draws_alike(monkeypatch):
    """Two ranks, each with its own groups: each rank's all-reduce returns the sum of both ranks' local
    counts, so both end with the same counts (and so the same chances and cursor). Simulated by
    pairing the two calls: rank 0's local vector is held until rank 1's arrives."""
    import pipeline.rl.group_sampling as gs

    levels = [1, 2, 1, 2]
    counts = {"1": [1.0, 0.0], "2": [1.0, 1.0]}
    local = {0: ([0, 1], torch.tensor([[1.0, 1.0], [0.0, 1.0]])),  # rank 0: level 1 flat, level 2 mixed
             1: ([2, 3], torch.tensor([[0.0, 1.0], [1.0, 1.0]]))}  # rank 1: level 1 mixed, level 2 flat
    seen = {}

    def record(values):
        seen[len(seen)] = list(values)
        return [0.0] * len(values)

    monkeypatch.setattr(gs.dist_utils, "sum_across_ranks", record)
    for rank in (0, 1):
        count_levels(counts, levels, *local[rank])
    total = [a + b for a, b in zip(seen[0], seen[1])]
    monkeypatch.setattr(gs.dist_utils, "sum_across_ranks", lambda values: total)
    out = [count_levels(counts, levels, *local[rank]) for rank in (0, 1)]
    d = LEVEL_DECAY
    assert out[0] == out[1]
    assert out[0]["1"] == pytest.approx([d + 2, 1]) and out[0]["2"] == pytest.approx([d + 2, d + 1])


def test_rows_without_an_integer_level_are_refused_naming_file_and_row():
    rows = [{"id": "a", "level": 1}, {"id": "b", "level": 2}, {"id": "c", "question": "x"}]
    with pytest.raises(InputError, match=r"^data/x.jsonl: row id 'c' has level = None, not an integer "
                                         r"\(warmup.level_sampling = informative .*\); allowed: .* or "
                                         r"warmup.level_sampling = uniform$"):
        row_levels(rows, Path("data/x.jsonl"), "warmup.level_sampling")
    with pytest.raises(InputError, match="row id 'd' has level = True"):
        row_levels([{"id": "d", "level": True}], Path("f"), "k")
    with pytest.raises(InputError, match="row id 'e' has level = '2'"):
        row_levels([{"id": "e", "level": "2"}], Path("f"), "k")
    assert row_levels([{"id": "a", "level": 2}, {"id": "b", "level": 1}], Path("f"), "k") == [2, 1]


def test_level_floor_out_of_range_is_refused():
    from pipeline.core.config_loading import ConfigError

    with pytest.raises(ConfigError, match=r"warmup.level_floor = 0.0 is out of range; allowed: a number in \(0, 1\]"):
        smoke_cfg("warmup.level_floor=0")
    with pytest.raises(ConfigError, match=r"warmup.level_sampling = 'greedy' is not allowed.*; allowed: uniform, informative"):
        smoke_cfg("warmup.level_sampling=greedy")


# --------------------------------------------------------------------------- in the stage

# A reward with variance on large answers only: |gold| < 20 (every level-1 problem, a few of level 2) always
# scores 1, so those groups are never informative; larger ones score by the parity of the completion's length.
_large_gold_parity = reward_of(lambda text, gold: 1.0 if abs(float(gold)) < 20 else float(len(text) % 2))


def test_the_stage_draws_from_the_informative_level(workdir, monkeypatch):
    """On the smoke curriculum (levels 1 and 2) level 1 never gives an informative group under this
    verifier: its chance falls towards the floor and the draw moves to level 2, while `uniform` keeps the
    stream's own mix; the counts are those of every group rolled out."""
    import pipeline.stages.grpo as grpo_stage

    drawn: list[list[int]] = []
    real = grpo_stage.sample_groups

    def recording(*a, **k):
        groups = real(*a, **k)
        drawn.append(groups.sampled_idx)
        return groups

    monkeypatch.setattr(grpo_stage, "sample_groups", recording)

    def run_iterations(mode: str, iters: int = 4):
        drawn.clear()
        cfg = smoke_cfg(f"warmup.iterations={iters}", f"warmup.level_sampling={mode}", "warmup.level_floor=0.05",
                        "warmup.dynamic_sampling=true", "warmup.prompts_per_iter=8", "warmup.group_size=4",
                        "warmup.rollout_len=8", "warmup.eval_every=0")
        run = grpo_stage.setup(cfg, "warmup", _large_gold_parity)
        state, metrics = grpo_stage.TrainState(total_iters=iters), {}
        for _ in range(iters):
            metrics, _ = grpo_stage.grpo_iteration(run, state)
            state.iteration += 1
        levels = [r["level"] for r in run.train_rows]
        late = [levels[i] for idx in drawn[1:] for i in idx]  # after the first iteration's counts
        return state, metrics, levels, sum(lv == 1 for lv in late) / len(late)

    state, metrics, levels, share = run_iterations("informative")
    assert metrics["level_keep/1"] < 0.3 and metrics["level_keep/2"] == 1.0
    assert state.level_counts["1"][1] == 0.0 and state.level_counts["2"][1] > 0
    groups_per_level = [sum(levels[i] == lv for idx in drawn for i in idx) for lv in (1, 2)]
    d = 0.9
    assert sum(state.level_counts[str(lv)][0] for lv in (1, 2)) <= sum(groups_per_level)
    assert sum(state.level_counts[str(lv)][0] for lv in (1, 2)) >= d ** 3 * sum(groups_per_level)
    stream = sum(lv == 1 for lv in levels) / len(levels)
    assert share < stream - 0.2, (share, stream)
    state_u, metrics_u, _, share_u = run_iterations("uniform")
    assert state_u.level_counts == {} and not any(k.startswith("level_") for k in metrics_u)
    assert abs(share_u - stream) < 0.2, (share_u, stream)


def test_a_killed_warmup_resumes_its_level_counts_bit_identically(workdir, monkeypatch, caplog):
    """Stopped right after its resume state at iteration 2 and run again, a warmup with level sampling
    ends with the weights and series of an uninterrupted run, bit for bit (CPU): the counts that set
    the chances are part of the state. A run that lost them would draw other prompts at iteration 3."""
    import pipeline.stages.grpo as grpo_stage

    cfg = smoke_cfg("warmup.iterations=4", "warmup.save_every=2", "warmup.level_sampling=informative",
                    "warmup.level_floor=0.05", "warmup.dynamic_sampling=true", "warmup.prompts_per_iter=8",
                    "warmup.group_size=4",
                    "warmup.rollout_len=8", "warmup.eval_every=0")
    grpo_stage.run_grpo(cfg, "warmup", rewards=_large_gold_parity)
    whole, series = weights(Path("checkpoints/warmup")), Path("plots/warmup.csv").read_text()

    class Killed(Exception):
        pass

    real = grpo_stage.save_resume

    def save_then_die(folder, it, key, state, *a, **k):
        assert state.level_counts["2"][1] > 0  # the state saved holds the counts
        real(folder, it, key, state, *a, **k)
        raise Killed

    monkeypatch.setattr(grpo_stage, "save_resume", save_then_die)
    with pytest.raises(Killed):
        grpo_stage.run_grpo(cfg, "warmup", rewards=_large_gold_parity)
    monkeypatch.setattr(grpo_stage, "save_resume", real)
    with caplog.at_level("INFO", logger="pipeline"):
        grpo_stage.run_grpo(cfg, "warmup", rewards=_large_gold_parity)
    assert "resuming from checkpoints/warmup.resume/step_000002" in caplog.text
    again = weights(Path("checkpoints/warmup"))
    assert all(torch.equal(again[k], whole[k]) for k in whole)
    assert Path("plots/warmup.csv").read_text() == series
