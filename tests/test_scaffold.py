"""GRPO's worked-example scaffold (`<stage>.fewshot_examples` / `fewshot_fade`): the share of prompts
shown the examples, hand-computed; which rows are shown, a seeded draw per (iteration, row) that leaves
every other random stream alone; the prompts the stage rolls out, the fade in its series, a bit-exact
resume, and bad input refused with the key or the file and row named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.core.errors import InputError
from pipeline.rl.group_sampling import Scaffold, scaffold_share
from tests.conftest import smoke_cfg, weights


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


def _scaffold(share: float, iteration: int = 3, seed: int = 0, examples=("What is 0 + 1?",), fits=lambda q: True):
    return Scaffold(lambda q: f"EXAMPLES {q}" if fits(q) else None, frozenset(examples), share, seed, iteration)


def test_every_row_but_the_examples_is_shown_at_share_one_and_none_at_zero():
    rows = _rows(50)
    full, none = _scaffold(1.0), _scaffold(0.0)
    assert [full.shown(i, r) for i, r in enumerate(rows)] == [None] + [f"EXAMPLES {r['question']}" for r in rows[1:]]
    assert all(none.shown(i, r) is None for i, r in enumerate(rows))
    # a prompt that would not leave room for the rollout stays bare
    long_ones = _scaffold(1.0, fits=lambda q: "7" not in q)
    assert [i for i, r in enumerate(rows) if long_ones.shown(i, r) is None] == [0, 7, 17, 27, 37, 47]


@pytest.mark.parametrize("share", [0.1, 0.5, 0.8])
def test_a_row_is_shown_with_the_share_and_the_same_row_alike_on_every_call(share):
    rows = _rows(4000)
    draw = [_scaffold(share).shown(i, r) is not None for i, r in enumerate(rows)]
    assert draw == [_scaffold(share).shown(i, r) is not None for i, r in enumerate(rows)]  # a resumed run: the same
    assert abs(sum(draw) / len(rows) - share) < 0.035  # ~4.5 standard errors at 4,000 rows
    # another iteration or seed draws other rows, as often
    for other in (_scaffold(share, iteration=4), _scaffold(share, seed=1)):
        again = [other.shown(i, r) is not None for i, r in enumerate(rows)]
        assert again != draw and abs(sum(again) / len(rows) - share) < 0.035
    # the draw takes nothing from torch's or Python's global streams
    torch.manual_seed(5)
    before = torch.rand(3)
    torch.manual_seed(5)
    import random
    random.seed(9)
    py = random.random()
    random.seed(9)
    [_scaffold(share).shown(i, r) for i, r in enumerate(rows[:50])]
    assert torch.equal(torch.rand(3), before) and random.random() == py


# --------------------------------------------------------------------------- in the stage

def _spy_prompts(monkeypatch) -> list[list[str]]:
    """The prompts of every rollout the GRPO stage starts, per call (the real rollout runs)."""
    import pipeline.rl.group_sampling as gs

    seen: list[list[str]] = []
    real = gs.rollout_prompts

    def recording(policy, prompts, *a, **k):
        seen.append(list(prompts))
        return real(policy, prompts, *a, **k)

    monkeypatch.setattr(gs, "rollout_prompts", recording)
    return seen


FADE = ("warmup.iterations=3", "warmup.fewshot_examples=2", "warmup.fewshot_fade=2", "warmup.prompts_per_iter=8",
        "warmup.eval_every=0", "warmup.rollout_len=8")


def test_the_stage_rolls_out_the_examples_then_fades_them_out(workdir, monkeypatch):
    """Iteration 1 shows every drawn prompt the first two training rows as worked examples, rendered
    as evaluation's few-shot entries are; iteration 3 (share 0) shows none, so the stage ends on the
    bare prompts. The series records the share and the bare and shown groups' figures."""
    import pandas as pd

    import pipeline.stages.grpo as grpo_stage
    from pipeline.data.prompts import fewshot_prompt
    from pipeline.data.schema import read_rows

    seen = _spy_prompts(monkeypatch)
    cfg = smoke_cfg(*FADE)
    grpo_stage.run_grpo(cfg, "warmup")
    train = read_rows(Path("data/arith_train.jsonl"))
    shots = [(r["question"], r["solution"]) for r in train[:2]]
    by_prompt = {r["prompt"]: r for r in train}
    run = grpo_stage.setup(cfg, "warmup")
    scaffolded = {fewshot_prompt(r["question"], shots, run.policy.tokenizer, cfg.data): r for r in train}
    first, last = seen[0], seen[-1]
    assert len(seen) == 3 and len(first) == 8
    assert all(p in scaffolded for p in first if p not in by_prompt)
    assert sum(p in scaffolded for p in first) >= 7  # all but a drawn example row (bare)
    for p in first:  # the examples, worked, in order, then the row's own prompt
        if p in scaffolded:
            row = scaffolded[p]
            assert 0 <= p.index(shots[0][1]) < p.index(shots[1][1]) < p.rindex(row["question"])
            assert p.endswith(row["prompt"]) and len(p) > len(row["prompt"]) + len(shots[0][1]) + len(shots[1][1])
    assert all(p in by_prompt for p in last)
    series = pd.read_csv("plots/warmup.csv")
    assert list(series.columns[-5:]) == grpo_stage.FEWSHOT_COLUMNS
    assert series["fewshot_share"].iloc[0] >= 7 / 8 and series["fewshot_share"].iloc[2] == 0.0
    shown_then = [sum(p in scaffolded for p in s) / len(s) for s in seen]
    assert list(series["fewshot_share"]) == pytest.approx(shown_then)
    assert series["reward_shown"].isna().iloc[2] and not series["reward_bare"].isna().iloc[2]
    assert ((series["well_formed_bare"].dropna() >= 0) & (series["well_formed_bare"].dropna() <= 1)).all()


def test_without_examples_the_series_keeps_its_columns(workdir):
    import pandas as pd

    import pipeline.stages.grpo as grpo_stage

    grpo_stage.run_grpo(smoke_cfg("warmup.iterations=1", "warmup.eval_every=0", "warmup.rollout_len=8"), "warmup")
    assert list(pd.read_csv("plots/warmup.csv").columns) == grpo_stage.CSV_COLUMNS


def test_a_killed_scaffolded_warmup_resumes_bit_identically(workdir, monkeypatch, caplog):
    """Stopped right after its resume state at iteration 2 (share 1/2) and run again, the warmup ends
    with the weights and series of an uninterrupted run, bit for bit (CPU): which rows are shown the
    examples is a function of the seed, iteration and row, not a stream the resume would have to hold."""
    import pipeline.stages.grpo as grpo_stage

    cfg = smoke_cfg("warmup.iterations=4", "warmup.save_every=2", "warmup.fewshot_examples=2",
                    "warmup.fewshot_fade=4", "warmup.prompts_per_iter=8", "warmup.eval_every=0",
                    "warmup.rollout_len=8")
    grpo_stage.run_grpo(cfg, "warmup")
    whole, series = weights(Path("checkpoints/warmup")), Path("plots/warmup.csv").read_text()

    class Killed(Exception):
        pass

    real = grpo_stage.save_resume

    def save_then_die(*a, **k):
        real(*a, **k)
        raise Killed

    monkeypatch.setattr(grpo_stage, "save_resume", save_then_die)
    with pytest.raises(Killed):
        grpo_stage.run_grpo(cfg, "warmup")
    monkeypatch.setattr(grpo_stage, "save_resume", real)
    with caplog.at_level("INFO", logger="pipeline"):
        grpo_stage.run_grpo(cfg, "warmup")
    assert "resuming from checkpoints/warmup.resume/step_000002" in caplog.text
    again = weights(Path("checkpoints/warmup"))
    assert all(torch.equal(again[k], whole[k]) for k in whole)
    assert Path("plots/warmup.csv").read_text() == series


# --------------------------------------------------------------------------- bad input

def test_a_fade_without_examples_is_refused_naming_the_key():
    from pipeline.core.config_loading import ConfigError

    with pytest.raises(ConfigError, match=r"grpo.fewshot_fade = 10 is out of range; allowed: 0 unless "
                                          r"grpo.fewshot_examples > 0"):
        smoke_cfg("grpo.fewshot_fade=10")
    with pytest.raises(ConfigError, match=r"warmup.fewshot_examples = 17 is out of range"):
        smoke_cfg("warmup.fewshot_examples=17")


def test_an_example_row_without_a_worked_solution_is_refused_naming_file_and_row(workdir):
    import pipeline.stages.grpo as grpo_stage

    path = Path("data/arith_train.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    del rows[1]["solution"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InputError, match=r"^data/arith_train.jsonl:2: missing or non-text 'solution'"):
        grpo_stage.setup(smoke_cfg(*FADE), "warmup")
