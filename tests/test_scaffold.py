"""GRPO's worked-example scaffold (`<stage>.fewshot_examples` / `fewshot_fade`): the share of prompts
shown the examples, hand-computed; which rows are shown, a seeded draw per (iteration, row) that leaves
every other random stream alone; the prompts the stage rolls out, the fade in its series, a bit-exact
resume, and bad input refused with the key or the file and row named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.core.errors import InputError
from pipeline.rl.group_sampling import Scaffold, scaffold_share
from tests.conftest import assert_resumes_bit_identically, smoke_cfg


@pytest.fixture
def workdir(grpo_workdir):
    return grpo_workdir


# --------------------------------------------------------------------------- the share and the draw

@pytest.mark.parametrize(("iteration", "fade", "share"), [
    (0, 30, 1.0), (15, 30, 0.5), (24, 30, 0.2), (29, 30, 1 / 30), (30, 30, 0.0), (45, 30, 0.0),
    (0, 1, 1.0), (1, 1, 0.0), (0, 0, 1.0), (500, 0, 1.0),
])
def test_the_share_falls_linearly_from_one_to_zero_at_the_fade(iteration, fade, share):
    assert scaffold_share(iteration, fade) == pytest.approx(share, abs=1e-12)


def _rows(n: int) -> list[dict]:
    return [{"question": f"What is {i} + 1?"} for i in range(n)]


SHARES = {1.0: (0, 0), 0.8: (2, 10), 0.5: (5, 10), 0.1: (9, 10), 0.0: (10, 10)}  # share: (iteration, fade)


def _scaffold(share: float, seed: int = 0, examples=("What is 0 + 1?",), fits=lambda q: True, shift: int = 0):
    iteration, fade = SHARES[share]
    s = Scaffold(lambda q: f"EXAMPLES {q}" if fits(q) else None, frozenset(examples), fade, seed)
    return s.at(iteration + shift) if shift else s.at(iteration)


def test_every_row_but_the_examples_is_shown_at_share_one_and_none_at_zero():
    rows = _rows(50)
    full, none = _scaffold(1.0), _scaffold(0.0)
    assert full.share == 1.0 and none.share == 0.0
    assert [full.prompt_for(i, r) for i, r in enumerate(rows)] == [None] + [f"EXAMPLES {r['question']}" for r in rows[1:]]
    assert all(none.prompt_for(i, r) is None for i, r in enumerate(rows))
    # a prompt that would not leave room for the rollout stays bare
    long_ones = _scaffold(1.0, fits=lambda q: "7" not in q)
    assert [i for i, r in enumerate(rows) if long_ones.prompt_for(i, r) is None] == [0, 7, 17, 27, 37, 47]


@pytest.mark.parametrize("share", [0.1, 0.5, 0.8])
def test_a_row_is_shown_with_the_share_and_the_same_row_alike_on_every_call(share):
    rows = _rows(4000)
    scaffold = _scaffold(share)
    assert scaffold.share == pytest.approx(share)
    draw = [scaffold.prompt_for(i, r) is not None for i, r in enumerate(rows)]
    assert draw == [_scaffold(share).prompt_for(i, r) is not None for i, r in enumerate(rows)]  # a resume: the same
    assert abs(sum(draw) / len(rows) - share) < 0.035  # ~4.5 standard errors at 4,000 rows
    # the same share at another iteration, or another seed, draws other rows, as often
    for other in (Scaffold(scaffold.prompt, scaffold.examples, scaffold.fade * 2, 0).at(scaffold.iteration * 2),
                  _scaffold(share, seed=1)):
        assert other.share == pytest.approx(share)
        again = [other.prompt_for(i, r) is not None for i, r in enumerate(rows)]
        assert again != draw and abs(sum(again) / len(rows) - share) < 0.035
    # the draw takes nothing from torch's or Python's global streams
    import random

    torch.manual_seed(5)
    random.seed(9)
    before, py = torch.rand(3), random.random()
    torch.manual_seed(5)
    random.seed(9)
    [scaffold.prompt_for(i, r) for i, r in enumerate(rows[:50])]
    assert torch.equal(torch.rand(3), before) and random.random() == py


def test_the_figures_are_over_every_group_rolled_out_and_summed_over_ranks(monkeypatch):
    """Hand-computed: three groups of two, one shown the examples; then a second rank whose groups are
    all shown, its sums added as the collective would."""
    from types import SimpleNamespace

    import pipeline.rl.metrics as rl_metrics

    groups = SimpleNamespace(sampled=torch.tensor([[1.2, 0.0], [1.0, 1.0], [0.2, 0.0]]),
                             sampled_shown=torch.tensor([[True, True], [False, False], [False, False]]),
                             sampled_formed=torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0]]))
    got = rl_metrics.scaffold_metrics(groups)
    assert got == pytest.approx({"fewshot_share": 1 / 3, "reward_bare": (1.0 + 1.0 + 0.2 + 0.0) / 4,
                                 "well_formed_bare": 1 / 4, "reward_shown": 0.6, "well_formed_shown": 0.5})
    other_rank = [0.0, 0.0, 0.0, 4.0, 4.4, 4.0]  # bare completions, rewards, tags; shown ones, rewards, tags
    monkeypatch.setattr(rl_metrics.dist_utils, "sum_across_ranks",
                        lambda values: [a + b for a, b in zip(values, other_rank)])
    got = rl_metrics.scaffold_metrics(groups)
    assert got == pytest.approx({"fewshot_share": 3 / 5, "reward_bare": 2.2 / 4, "well_formed_bare": 1 / 4,
                                 "reward_shown": (1.2 + 4.4) / 6, "well_formed_shown": 5 / 6})
    alone = SimpleNamespace(sampled=groups.sampled[1:], sampled_shown=groups.sampled_shown[1:],
                            sampled_formed=groups.sampled_formed[1:])
    monkeypatch.undo()
    assert rl_metrics.scaffold_metrics(alone)["reward_shown"] is None
    # guide mode: part of a group shown
    mixed = SimpleNamespace(sampled=torch.tensor([[1.2, 1.2, 1.0, 0.0]]), sampled_shown=torch.tensor([[True, False, False, False]]),
                            sampled_formed=torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    assert rl_metrics.scaffold_metrics(mixed) == pytest.approx({
        "fewshot_share": 0.25, "reward_bare": 2.2 / 3, "well_formed_bare": 1 / 3, "reward_shown": 1.2,
        "well_formed_shown": 1.0})


@pytest.mark.parametrize(("share", "G", "k"), [(1.0, 8, 4), (0.8, 8, 3), (0.5, 8, 2), (0.1, 8, 0), (0.0, 8, 0),
                                              (1.0, 4, 2), (0.5, 4, 1), (1.0, 2, 1)])
def test_guide_mode_samples_half_a_group_after_the_examples_at_share_one(share, G, k):
    iteration, fade = SHARES[share]
    assert Scaffold(lambda q: q, frozenset(), fade, 0, "guide").at(iteration).guided(G) == k


def test_a_guided_rollout_is_the_examples_responses_after_the_bare_prompt(grpo_prepared):
    """Each row's first k completions are those the plain rollout samples after the examples, the rest
    those it samples after the bare prompt (the same generator, in that order); every one of the G
    follows the bare prompt's token ids, so the update trains them as its answers. A row without a
    scaffolded prompt (an example row) gets G bare completions."""
    from pipeline.rl.group_sampling import guided_rollout, select_rollouts
    from pipeline.rl.rollout import rollout_prompts
    from pipeline.train.checkpoint import load_policy

    policy = load_policy(grpo_prepared / "checkpoints" / "sft")
    tok, G, k = policy.tokenizer, 4, 1
    conf = smoke_cfg("warmup.group_size=4", "warmup.rollout_len=6").warmup
    batch = [{"prompt": f"Question: What is {i} + 2?\nAnswer:"} for i in range(3)]
    scaffolded = ["Question: 1 + 1?\nAnswer: <answer>2</answer>\n\n" + batch[0]["prompt"], None,
                  "Question: 1 + 1?\nAnswer: <answer>2</answer>\n\n" + batch[2]["prompt"]]
    gen = torch.Generator().manual_seed(3)
    ro, guided = guided_rollout(policy, batch, scaffolded, k, conf, gen)
    assert guided.tolist() == [[True, False, False, False], [False] * 4, [True, False, False, False]]
    gen = torch.Generator().manual_seed(3)
    args = (conf.rollout_len, conf.temperature, conf.top_p, conf.top_k)
    ref_guided = rollout_prompts(policy, [scaffolded[0], scaffolded[2]], k, *args, generator=gen)
    ref_rest = rollout_prompts(policy, [batch[0]["prompt"], batch[2]["prompt"]], G - k, *args, generator=gen)
    ref_plain = rollout_prompts(policy, [batch[1]["prompt"]], G, *args, generator=gen)
    order = [(ref_guided, [0]), (ref_rest, [0, 1, 2]), (ref_plain, [0, 1, 2, 3]), (ref_guided, [1]), (ref_rest, [3, 4, 5])]
    ref = select_rollouts(order, tok.pad_id)
    assert ro.texts == ref.texts
    P = ro.prompt_len
    for i in range(len(ro.texts)):
        j = i // G
        prompt = ro.input_ids[i, :P][ro.attention_mask[i, :P].bool()].tolist()
        assert prompt == tok.encode(batch[j]["prompt"])  # every completion follows the bare prompt
        mine = ro.input_ids[i, P:][ro.response_mask[i, P:].bool()]
        theirs = ref.input_ids[i, ref.prompt_len:][ref.response_mask[i, ref.prompt_len:].bool()]
        assert torch.equal(mine, theirs) and int(ro.response_lengths[i]) == int(ref.response_lengths[i])
    assert torch.equal(ro.truncated, ref.truncated)


# --------------------------------------------------------------------------- in the stage

def _spy_prompts(monkeypatch) -> list[list[str]]:
    """The prompts of every rollout the GRPO stage starts, per iteration (the real rollouts run)."""
    import pipeline.rl.group_sampling as gs
    import pipeline.stages.grpo as grpo_stage

    seen: list[list[str]] = []
    real_rollout, real_sample = gs.rollout_prompts, grpo_stage.sample_groups

    def sampling(*a, **k):
        seen.append([])
        return real_sample(*a, **k)

    def rollout(policy, prompts, *a, **k):
        seen[-1].extend(prompts)
        return real_rollout(policy, prompts, *a, **k)

    monkeypatch.setattr(gs, "rollout_prompts", rollout)
    monkeypatch.setattr(grpo_stage, "sample_groups", sampling)
    return seen


FADE = ("warmup.iterations=3", "warmup.fewshot_examples=2", "warmup.fewshot_fade=2", "warmup.prompts_per_iter=8",
        "warmup.eval_every=0", "warmup.rollout_len=8", "warmup.max_sampling_rounds=2")


def _scaffolded_prompts(cfg) -> tuple[dict[str, dict], dict[str, dict], list[tuple[str, str]]]:
    """{bare prompt: row}, {prompt after the first two rows as worked examples: row}, the examples."""
    import pipeline.stages.grpo as grpo_stage
    from pipeline.data.prompts import fewshot_prompt
    from pipeline.data.schema import read_rows

    train = read_rows(Path("data/arith_train.jsonl"))
    shots = [(r["question"], r["solution"]) for r in train[:2]]
    tok = grpo_stage.setup(cfg, "warmup").policy.tokenizer
    return ({r["prompt"]: r for r in train}, {fewshot_prompt(r["question"], shots, tok, cfg.data): r for r in train},
            shots)


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_stage_rolls_out_the_examples_then_fades_them_out(workdir, monkeypatch, dynamic):
    """Iteration 1 shows every drawn prompt the first two training rows as worked examples, rendered
    as evaluation's few-shot entries are; iteration 3 (share 0) shows none, so the stage ends on the
    bare prompts. The series records the share over every group rolled out (with dynamic sampling the
    dropped ones included), and the bare and shown groups' figures."""
    import pandas as pd

    import pipeline.stages.grpo as grpo_stage

    seen = _spy_prompts(monkeypatch)
    cfg = smoke_cfg(*FADE, f"warmup.dynamic_sampling={str(dynamic).lower()}")
    grpo_stage.run_grpo(cfg, "warmup")
    by_prompt, scaffolded, shots = _scaffolded_prompts(cfg)
    first, last = seen[0], seen[-1]
    assert len(seen) == 3 and len(first) >= 8
    assert all(p in scaffolded or p in by_prompt for s in seen for p in s)
    assert sum(p in scaffolded for p in first) >= len(first) - 2  # all but drawn example rows (bare)
    for p in first:  # the examples, worked, in order, then the row's own prompt
        if p in scaffolded:
            row = scaffolded[p]
            assert 0 <= p.index(shots[0][1]) < p.index(shots[1][1]) < p.rindex(row["question"])
            assert p.endswith(row["prompt"]) and len(p) > len(row["prompt"]) + len(shots[0][1]) + len(shots[1][1])
    assert all(p in by_prompt for p in last)
    series = pd.read_csv("plots/warmup.csv")
    assert list(series.columns[-7:-2]) == grpo_stage.FEWSHOT_COLUMNS  # then the reward parts
    shown_then = [sum(p in scaffolded for p in s) / len(s) for s in seen]  # over every group rolled out
    assert list(series["fewshot_share"]) == pytest.approx(shown_then)
    assert shown_then[0] >= 0.75 and shown_then[2] == 0.0
    assert series["reward_shown"].isna().iloc[2] and not series["reward_bare"].isna().iloc[2]
    assert ((series["well_formed_bare"].dropna() >= 0) & (series["well_formed_bare"].dropna() <= 1)).all()


def test_guide_mode_trains_every_completion_as_the_bare_prompts_answer(workdir, monkeypatch):
    """In `guide` mode the first iteration samples half of each group after the examples (the share
    in the series: 1/2 less the example rows), every row the update trains starts with a bare prompt,
    and the old log-probs are recomputed, not the guided sampling's (they belong to another prompt)."""
    import pandas as pd

    import pipeline.stages.grpo as grpo_stage

    seen = _spy_prompts(monkeypatch)
    trained: list[torch.Tensor] = []
    sampled_arg: list[object] = []
    real_update, real_old = grpo_stage.update, grpo_stage.old_and_ref_logprobs

    def update(policy, optimizer, conf, batch, *a, **k):
        trained.append(batch.input_ids[:, : batch.start].clone())
        return real_update(policy, optimizer, conf, batch, *a, **k)

    def old_and_ref(policy, ref, conf, ids, attn, start, sampled=None, *a):
        sampled_arg.append(sampled)
        return real_old(policy, ref, conf, ids, attn, start, sampled, *a)

    monkeypatch.setattr(grpo_stage, "update", update)
    monkeypatch.setattr(grpo_stage, "old_and_ref_logprobs", old_and_ref)
    cfg = smoke_cfg(*FADE, "warmup.fewshot_mode=guide")
    grpo_stage.run_grpo(cfg, "warmup")
    by_prompt, scaffolded, _ = _scaffolded_prompts(cfg)
    tok = grpo_stage.setup(cfg, "warmup").policy.tokenizer
    bare_ids = {tuple(tok.encode(p)) for p in by_prompt}
    for prompts in trained:
        for row in prompts:
            assert tuple(t for t in row.tolist() if t != tok.pad_id) in bare_ids
    assert any(p in scaffolded for p in seen[0]) and all(p in by_prompt for p in seen[-1])
    series = pd.read_csv("plots/warmup.csv")
    guided_rows = sum(p in scaffolded for p in seen[0])  # each guided row's prompt, rolled out for k = 2 of 4
    assert 0 < series["fewshot_share"].iloc[0] <= 0.5 and series["fewshot_share"].iloc[2] == 0.0
    assert sampled_arg[0] is None and sampled_arg[2] is not None  # guided: recomputed; none guided: reused
    assert series["fewshot_share"].iloc[0] == pytest.approx(guided_rows * 2 / (8 * 4)) and guided_rows >= 6


def test_without_examples_the_series_keeps_its_columns(workdir):
    import pandas as pd

    import pipeline.stages.grpo as grpo_stage

    grpo_stage.run_grpo(smoke_cfg("warmup.iterations=1", "warmup.eval_every=0", "warmup.rollout_len=8"), "warmup")
    assert list(pd.read_csv("plots/warmup.csv").columns) == grpo_stage.CSV_COLUMNS + ["reward/correct", "reward/format"]


@pytest.mark.parametrize("mode", ["prompt", "guide"])
def test_a_killed_scaffolded_warmup_resumes_bit_identically(workdir, monkeypatch, caplog, mode):
    """Stopped right after its resume state at iteration 2 (share 1/2) and run again, the warmup ends
    with the weights and series of an uninterrupted run, bit for bit (CPU): which rows are shown the
    examples is a function of the seed, iteration and row, not a stream the resume would have to hold."""
    import pipeline.stages.grpo as grpo_stage

    cfg = smoke_cfg("warmup.iterations=4", "warmup.save_every=2", "warmup.fewshot_examples=2",
                    "warmup.fewshot_fade=4", "warmup.prompts_per_iter=8", "warmup.eval_every=0",
                    "warmup.rollout_len=8", f"warmup.fewshot_mode={mode}")
    assert_resumes_bit_identically(grpo_stage, lambda: grpo_stage.run_grpo(cfg, "warmup"), "warmup", monkeypatch, caplog)


# --------------------------------------------------------------------------- bad input

def test_a_fade_without_examples_or_past_the_last_iteration_is_refused_naming_the_key():
    from pipeline.core.config_loading import ConfigError

    with pytest.raises(ConfigError, match=r"grpo.fewshot_fade = 10 is out of range; allowed: 0 unless "
                                          r"grpo.fewshot_examples > 0"):
        smoke_cfg("grpo.fewshot_fade=10")
    with pytest.raises(ConfigError, match=r"warmup.fewshot_fade = 4 is out of range; allowed: an integer in "
                                          r"\[0, warmup.iterations\]"):
        smoke_cfg("warmup.iterations=3", "warmup.fewshot_examples=2", "warmup.fewshot_fade=4")
    with pytest.raises(ConfigError, match=r"warmup.fewshot_examples = 17 is out of range"):
        smoke_cfg("warmup.fewshot_examples=17")
    smoke_cfg("warmup.iterations=3", "warmup.fewshot_examples=2", "warmup.fewshot_fade=3")


def test_examples_that_leave_no_room_for_the_rollout(workdir, caplog):
    """A context where the examples fit before the shortest questions only: the longer prompts stay bare
    (logged once); a context too short for the examples alone is refused naming the key and the limits."""
    import pipeline.stages.grpo as grpo_stage

    cfg = smoke_cfg(*FADE)
    run = grpo_stage.setup(cfg, "warmup")
    tok, limit = run.policy.tokenizer, run.policy.max_len
    _, scaffolded, _ = _scaffolded_prompts(cfg)
    lengths = sorted({len(tok.encode(p)) for p in scaffolded})
    assert len(lengths) > 1
    cfg = smoke_cfg(*FADE, f"warmup.rollout_len={limit - lengths[0]}")
    run = grpo_stage.setup(cfg, "warmup")
    rows = run.train_rows
    with caplog.at_level("WARNING", logger="pipeline"):
        shown = [run.prompts.scaffold.prompt_for(i, r) for i, r in enumerate(rows[:200])]
    assert caplog.text.count("some prompts leave no room") == 1
    assert any(p is None for p in shown[2:]) and all(p is None or len(tok.encode(p)) == lengths[0] for p in shown)
    from pipeline.data.prompts import fewshot_prompt

    alone = len(tok.encode(fewshot_prompt("", _scaffolded_prompts(cfg)[2], tok, cfg.data)))
    assert alone < lengths[0]
    with pytest.raises(InputError, match=rf"^warmup.fewshot_examples = 2: the worked examples of "
                                         rf"data/arith_train.jsonl alone take {alone} tokens, more than the "
                                         rf"{alone - 1} a prompt may have with warmup.rollout_len = "
                                         rf"{limit - alone + 1} in model.block_size = {limit}; allowed: "):
        grpo_stage.setup(smoke_cfg(*FADE, f"warmup.rollout_len={limit - alone + 1}"), "warmup")
