"""experiments/plateau.py: the reference check, the fresh problems (disjoint by expression, levels
round-robin), the checkpoint keeper, and the per-problem moves and their report."""

import random
import shutil
import time

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from experiments.learning import plateau_move
from experiments.plateau import (Keeper, expression_of, fresh_rows, mixed_bootstrap, moves, reference_step, report,
                           stored_key)
from pipeline.data.arithmetic import MAX_LEVEL, PHRASINGS, sample_problem, to_row
from pipeline.rewards.parsing import extract_answer


def test_reference_step_is_the_check_nearest_80_percent():
    assert reference_step(4500, 450) == 3600  # the default: checks every 10% of the run
    assert reference_step(1250, 250) == 1000
    assert reference_step(300, 50) == 250  # 240 -> the nearest check
    assert reference_step(1000, 300) == 900  # checks 300, 600, 900: 900 is nearest 800
    with pytest.raises(SystemExit):
        reference_step(400, 500)  # no check before the end
    with pytest.raises(SystemExit, match="eval_every"):
        reference_step(400, 0)


@given(st.integers(2, 5000), st.integers(1, 1000))
def test_reference_step_is_the_check_experiments_learning_compares(steps, every):
    """The same check as experiments/learning.py's plateau_move reads off plots/sft.csv (checks at every
    `every` steps and at the end)."""
    checks = list(range(every, steps, every))
    if not checks:
        return
    curve = [(c, float(c)) for c in checks] + [(steps, float(steps))]
    assert plateau_move(curve) == steps - reference_step(steps, every)


@given(st.integers(1, MAX_LEVEL), st.integers(0, 2**32 - 1))
def test_expression_of_inverts_every_phrasing(level, seed):
    rng = random.Random(seed)
    p = sample_problem(level, rng)
    for phrasing in PHRASINGS:
        assert expression_of(phrasing.format(e=p.expr)) == p.expr
    assert expression_of(to_row(p, "x", rng, "{question}")["question"]) == p.expr


def test_expression_of_rejects_other_text():
    for bad in ("", "What is?", "Natalia sold clips to 48 friends.", "Compute ."):
        with pytest.raises(ValueError):
            expression_of(bad)


def test_fresh_rows_are_new_distinct_round_robin_and_deterministic():
    rng = random.Random(0)
    used = {sample_problem(level, rng).expr for level in (2, 3, 4) for _ in range(500)}
    rows = fresh_rows(used, 300, 4, "{question}", "digits")
    exprs = [expression_of(r["question"]) for r in rows]
    assert len(set(exprs)) == 300 and not set(exprs) & used
    assert [r["level"] for r in rows] == [2, 3, 4] * 100
    for r in rows:  # the gold answer is the worked solution's own
        assert float(extract_answer(r["solution"])) == r["gold"]
    assert rows == fresh_rows(used, 300, 4, "{question}", "digits")
    assert rows != fresh_rows(used, 300, 4, "{question}", "digits", seed="another")
    with pytest.raises(SystemExit):
        fresh_rows(set(), 10, 1, "{question}", "digits")  # level 1 only: nothing to draw from


def test_fresh_rows_stop_when_a_level_runs_out():
    rng = random.Random(0)
    all_level2 = {f"{a} {op} {b}" for a in range(10, 100) for b in range(10, 100) for op in "+-"
                  if not (op == "-" and b > a)}
    assert sample_problem(2, rng).expr in all_level2
    with pytest.raises(SystemExit, match="level 2"):
        fresh_rows(all_level2, 3, 2, "{question}", "digits")


def checkpoint_folder(folder, key, weights=b"weights"):
    """A resumable-checkpoint look-alike, written whole under a temporary name and renamed, as they are."""
    from pipeline.train.manifest import TRAIN_JSON

    tmp = folder.with_name(folder.name + ".writing")
    tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(weights)
    (tmp / TRAIN_JSON).write_text(f'{{"extra": {{"key": "{key}", "state": {{}}}}}}')
    return tmp


def wait_for(path, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_keeper_copies_the_folder_of_its_key_once_it_appears(tmp_path):
    src, dst = tmp_path / "resume" / "step_000250", tmp_path / "kept"
    with Keeper(src, dst, "k1", poll_s=0.02):
        time.sleep(0.1)
        checkpoint_folder(src, "k1").rename(src)
        wait_for(dst)
    assert (dst / "model.safetensors").read_bytes() == b"weights" and stored_key(dst) == "k1"
    assert not dst.with_name("kept.tmp").exists()


def test_keeper_ignores_a_folder_left_by_other_params(tmp_path):
    """A resume state of other params or data (another key), which the stage ignores, is not kept either;
    the stage's own state at that step, written later, is."""
    src, dst = tmp_path / "resume" / "step_000250", tmp_path / "kept"
    checkpoint_folder(src, "old", b"stale").rename(src)
    with Keeper(src, dst, "new", poll_s=0.02):
        time.sleep(0.2)
        assert not dst.exists()
        shutil.rmtree(src)
        checkpoint_folder(src, "new", b"fresh").rename(src)
        wait_for(dst)
    assert (dst / "model.safetensors").read_bytes() == b"fresh"


def test_keeper_raises_what_went_wrong_while_copying(tmp_path):
    src, dst = tmp_path / "resume" / "step_000250", tmp_path / "kept"
    tmp = checkpoint_folder(src, "k")
    (tmp / "dangling").symlink_to(tmp_path / "nowhere")  # copytree follows links: this one fails
    tmp.rename(src)
    with pytest.raises(SystemExit, match="copying .*step_000250"):
        with Keeper(src, dst, "k", poll_s=0.02):
            time.sleep(0.3)
    assert not dst.exists()


def test_moves_and_report_are_paired_per_problem():
    result = {"seed": 0, "ref_step": 3600, "last_step": 4500, "sft_curve": [[3600, 0.5], [4500, 0.5]],
              "held_out_levels": [1, 1, 2, 3], "fresh_levels": [2, 3, 2, 3],
              "ref": {"held_out": [1, 0, 1, 0], "fresh": [1, 1, 0, 0]},
              "last": {"held_out": [0, 1, 1, 0], "fresh": [1, 1, 1, 1]}}
    assert moves(result, "held_out") == [-1, 1, 0, 0]
    assert moves(result, "fresh") == [0, 0, 1, 1]
    table = report([result])
    seed = table["per_seed"][0]
    assert seed["stage_check"] == [0.5, 0.5] and seed["held_out"]["ref"] == seed["held_out"]["last"] == 0.5
    assert seed["held_out"]["move"] == 0.0 and seed["held_out"]["up_down"] == [1, 1]
    assert seed["fresh"]["move"] == 0.5 and seed["fresh"]["up_down"] == [2, 0]
    assert seed["fresh_by_level"] == {"2": 0.5, "3": 0.5}
    low, high = seed["held_out"]["ci95"]
    assert -1 <= low < 0 < high <= 1  # one up, one down: an interval around no move
    assert table["mean_fresh"]["move"] == 0.5
    assert seed["reproduces_stage_check"]
    # the held-out mix: half level 1 (its two problems moved -1 and +1: 0) and half the fresh move (+0.5)
    assert seed["held_out_mix"]["move"] == pytest.approx(0.25)
    result["sft_curve"] = [[3600, 0.75], [4500, 0.5]]  # a stage check the kept checkpoint does not reproduce
    assert not report([result])["per_seed"][0]["reproduces_stage_check"]


def _seed_result(seed: int, held_moves: list[int], fresh_moves: list[int]) -> dict:
    """A result whose final checkpoint moved by `*_moves` per problem (the 80% one got every problem wrong
    where the move is 0 or +1, right where it is -1)."""
    def pair(ms):
        return [int(m < 0) for m in ms], [int(m < 0) + m for m in ms]
    (hr, hl), (fr, fl) = pair(held_moves), pair(fresh_moves)
    n = len(held_moves)
    return {"seed": seed, "held_out_levels": [1] * (n // 2) + [2] * (n - n // 2),
            "ref": {"held_out": hr, "fresh": fr}, "last": {"held_out": hl, "fresh": fl}}


def test_the_mix_over_identical_seeds_is_the_one_seed_interval():
    """Seeds scored on the same problems share each problem draw: three copies of one seed's result give
    exactly its interval (resampling each seed's problems apart would shrink it by about sqrt(3))."""
    one = _seed_result(0, [1, 0, -1, 1, 0, 0, 1, -1], [1, 0, 0, -1, 1, 1, 0, 0, 1, 0, -1, 0])
    alone = mixed_bootstrap([one], np.random.default_rng(5))
    assert alone[0] == pytest.approx(0.5 * 0.25 + 0.5 * (2 / 12))  # level 1: (1 + 0 - 1 + 1) / 4
    assert alone[1] < alone[0] < alone[2]
    copies = mixed_bootstrap([one, {**one, "seed": 1}, {**one, "seed": 2}], np.random.default_rng(5))
    assert copies == pytest.approx(alone, abs=1e-12)


def test_the_mix_over_seeds_resamples_the_seeds():
    """Each seed's every problem moved alike (-1, 0, +1): only the seeds vary, and the mean of three draws
    from them is -1 with probability 1/27 > 2.5%: the interval is [-1, 1]."""
    results = [_seed_result(s, [m] * 4, [m] * 6) for s, m in enumerate((-1, 0, 1))]
    assert mixed_bootstrap(results, np.random.default_rng(0)) == pytest.approx((0.0, -1.0, 1.0))


def test_the_mix_over_seeds_needs_the_same_problems():
    with pytest.raises(ValueError, match="different problem sets"):
        mixed_bootstrap([_seed_result(0, [1, 0], [1, 0, 1]), _seed_result(1, [1, 0], [1, 0])],
                        np.random.default_rng(0))


@pytest.fixture
def gpt_policy():
    """A 2-layer, 32-wide from-scratch GPT taught for a few steps to answer "Question: ...\nAnswer:" with
    `<answer>N</answer>` (a random one repeats one token and writes no number)."""
    import torch
    import torch.nn.functional as F

    from pipeline.core.config import ModelConfig
    from pipeline.data.tokenizer import train_tokenizer
    from pipeline.model.policy import build_policy

    rng = random.Random(0)
    texts = [f"Question: What is {a} + {b}?\nAnswer: <answer>{a + b}</answer>"
             for a, b in ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(64))]
    torch.manual_seed(0)
    tok = train_tokenizer(texts, vocab_size=320)
    policy = build_policy(ModelConfig(backend="gpt", n_layer=2, n_head=2, n_embd=32, block_size=128, device="cpu"),
                          tok)
    ids = [tok.encode(t) for t in texts]
    width = max(map(len, ids))
    x = torch.tensor([i + [tok.pad_id] * (width - len(i)) for i in ids])
    opt = torch.optim.AdamW(policy.module.parameters(), lr=1e-2)
    for _ in range(30):
        logits = policy.module(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), ignore_index=tok.pad_id)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return policy.eval()


def test_greedy_rows_are_the_stage_check_row_by_row(gpt_policy):
    """Per row, in order, what the SFT stage's own held-out check counts (pipeline.rl.generation.greedy_correct):
    golds are set from the policy's own greedy answers on even rows and to an unreachable value on odd ones."""
    from pipeline.rl.generation import EVAL_BATCH, generate, greedy_correct, greedy_correct_rows

    rng, policy = random.Random(3), gpt_policy.eval()
    rows = [to_row(sample_problem(1, rng), f"r{i}", rng, "Question: {question}\nAnswer:")
            for i in range(EVAL_BATCH + 6)]  # more than one decoding batch
    texts, _, _ = generate(policy, [r["prompt"] for r in rows], batch_size=EVAL_BATCH, max_new_tokens=12)
    expected = []
    for i, (r, text) in enumerate(zip(rows, texts)):
        answer = extract_answer(text)
        r["gold"] = answer if (i % 2 == 0 and answer is not None) else -0.5
        expected.append(int(r["gold"] != -0.5))
    assert sum(expected) >= 5  # the tiny model writes numbers, so there is something to match
    assert greedy_correct_rows(policy, rows, 12) == expected
    assert sum(expected) == greedy_correct(policy, rows, 12)


def test_budget_is_the_sft_checks_own(tmp_path, monkeypatch):
    """The held-out check's generation budget (pipeline.stages.sft.check_budget) is what the stage uses, and a
    small context caps it."""
    from pipeline.core.config_loading import load_config
    from pipeline.stages import sft
    from pipeline.stages.prepare import run_prepare
    from pipeline.stages.sft import check_budget as budget

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    overrides = [f"data.gsm8k_source={root / 'tests' / 'fixtures' / 'gsm8k'}", "sft.eval_samples=8"]
    cfg = load_config(root / "configs" / "smoke.yaml", overrides)
    run_prepare(cfg)
    run = sft.setup(cfg, "sft")
    assert budget(run.tok, run.eval_rows, cfg.model.block_size) == run.max_new
    assert budget(run.tok, run.eval_rows, 40) == max(1, 40 - max(len(t) for t in run.tok.encode_batch(
        [r["prompt"] for r in run.eval_rows])))  # a small context caps it
