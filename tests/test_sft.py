"""SFT stage and the shared training helpers: LR schedule, AdamW groups, batching and loss masking,
a tiny SFT run whose loss falls (deterministically), and the `model.init` skip path."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.config_loading import load_config
from pipeline.core.errors import InputError
from pipeline.data import sft_batches
from pipeline.stages import sft
from pipeline.train.optim import build_optimizer, lr_at, param_groups

from tests.conftest import GSM8K, REPO


# --------------------------------------------------------------------------- schedule and optimiser


def test_lr_schedule_hand_checked():
    lrs = [lr_at(s, 10, 1.0, warmup_steps=2) for s in range(12)]
    assert lrs[:3] == [0.5, 1.0, 1.0]  # linear warmup, then the peak at the first cosine step
    assert lrs[9] == pytest.approx(0.1) and lrs[10:] == [pytest.approx(0.1)] * 2  # min at the last step
    assert lrs[5] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 7)))
    assert [lr_at(s, 10, 2.0, 3, "constant") for s in (0, 2, 3, 9, 50)] == [2 / 3, 2.0, 2.0, 2.0, 2.0]
    assert lr_at(0, 1, 1.0) == pytest.approx(0.1)  # a one-step run ends at the floor, no division by zero
    with pytest.raises(ValueError, match="allowed: cosine, constant"):
        lr_at(0, 10, 1.0, schedule="linear")


@settings(max_examples=30, deadline=None)
@given(total=st.integers(1, 200), warmup=st.integers(0, 30), peak=st.floats(1e-6, 1.0))
def test_lr_schedule_properties(total, warmup, peak):
    lrs = [lr_at(s, total, peak, warmup) for s in range(total + 5)]
    assert all(0 < lr <= peak * (1 + 1e-9) for lr in lrs)
    assert all(a < b for a, b in zip(lrs[:warmup], lrs[1:warmup]))  # warmup rises linearly
    after = lrs[warmup:]
    assert all(lr >= 0.1 * peak * (1 - 1e-9) for lr in after)
    assert all(a >= b - 1e-12 for a, b in zip(after, after[1:]))  # never rises after warmup


def test_param_groups_decay_only_matrices(gpt_policy):
    module = gpt_policy.module
    groups = param_groups(module, 0.1)
    decay, no_decay = ({id(p) for p in g["params"]} for g in groups)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    names = {id(p): n for n, p in module.named_parameters()}
    assert decay.isdisjoint(no_decay) and decay | no_decay == set(names)  # every parameter once (tied: once)
    for pid in no_decay:  # norms, biases, embeddings
        assert module.get_parameter(names[pid]).ndim < 2 or "wte" in names[pid] or "wpe" in names[pid]
    assert all(module.get_parameter(names[pid]).ndim == 2 for pid in decay) and decay
    embedding = next(m for m in module.modules() if isinstance(m, torch.nn.Embedding))
    assert id(embedding.weight) in no_decay
    opt = build_optimizer(module, 1e-3, 0.1)
    assert isinstance(opt, torch.optim.AdamW) and len(opt.param_groups) == 2


# --------------------------------------------------------------------------- batching and the loss

def test_collate_masks_exactly_the_response():
    ids, attn, target = sft_batches.collate([([5, 6, 7, 8, 1], 3), ([5, 9, 1], 1)], pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7, 8, 1], [5, 9, 1, 0, 0]]
    assert attn.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert target.tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 0, 0]]


def test_response_nll_ignores_prompt_and_padding(gpt_policy):
    torch.manual_seed(0)
    V = gpt_policy.tokenizer.vocab_size
    a = (torch.randint(4, V, (9,)).tolist(), 5)
    b = (torch.randint(4, V, (4,)).tolist(), 2)
    gpt_policy.eval()
    torch.set_grad_enabled(False)
    nll, n = sft.response_nll(gpt_policy, *sft_batches.collate([a, b], 0, gpt_policy.device))
    assert n == (9 - 5) + (4 - 2)
    expected = 0.0
    for seq, n_prompt in (a, b):  # reference: one unpadded sequence at a time
        x = torch.tensor([seq])
        logp = gpt_policy.logits(x, torch.ones_like(x))[0].float().log_softmax(-1)
        expected -= sum(float(logp[t - 1, seq[t]]) for t in range(n_prompt, len(seq)))
    torch.set_grad_enabled(True)
    assert float(nll) == pytest.approx(expected, rel=1e-5)


def _batch(V: int, prefix: int, lengths: list[tuple[int, int]], seed: int = 0) -> list[sft.Example]:
    """Sequences sharing their first `prefix` tokens (a prompt template), then random tokens; (length, prompt)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(4, V, (prefix,), generator=g).tolist()
    return [(head + torch.randint(4, V, (n - prefix,), generator=g).tolist(), p) for n, p in lengths]


def _loss_and_grads(policy, chunks: list[list[sft.Example]], plain: bool) -> tuple[float, list[torch.Tensor]]:
    from pipeline.model import fast

    policy.module.zero_grad(set_to_none=True)
    total = 0.0
    for chunk in chunks:
        with fast.plain() if plain else contextlib.nullcontext():
            nll, _ = sft.response_nll(policy, *sft_batches.collate(chunk, 0, policy.device))
        nll.backward()
        total += float(nll.detach())
    return total, [p.grad.clone() for p in policy.module.parameters()]


def test_shared_columns_stop_at_the_first_difference_pad_or_response():
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 3, 0], [5, 6, 7, 8, 0]])
    attn = (ids != 0).long()
    none = torch.zeros_like(ids)
    assert sft_batches.shared_columns(ids, attn, none) == 3  # column 3 differs (8 vs 3)
    target = none.clone()
    target[0, 2] = 1  # a response token in column 2 of one row: the shared run stops before it
    assert sft_batches.shared_columns(ids, attn, target) == 2
    assert sft_batches.shared_columns(ids[:1], attn[:1], none[:1]) == 0  # one row shares with nobody
    ids[1, 0] = 4
    assert sft_batches.shared_columns(ids, attn, none) == 0


@pytest.mark.parametrize("lengths", [
    [(12, 7), (9, 6), (15, 8), (7, 5)],  # a shared 5-token prefix, prompts 5-8 tokens
    [(6, 5), (6, 5), (11, 9)],  # a row whose response starts right after the prefix
    [(10, 3), (14, 6)],  # a prompt shorter than the shared tokens: the shared run stops at its response
])
def test_shared_prefix_loss_and_gradients_equal_the_plain_path(gpt_policy, lengths):
    """The fast path (shared template columns run once, vocabulary projection from the first response
    column) against the plain one: one padded forward over every column."""
    gpt_policy.train()
    batch = _batch(gpt_policy.tokenizer.vocab_size, 5, lengths)
    plain, g_plain = _loss_and_grads(gpt_policy, [batch], plain=True)
    fast, g_fast = _loss_and_grads(gpt_policy, [batch], plain=False)
    assert fast == pytest.approx(plain, rel=1e-5)
    for a, b in zip(g_fast, g_plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_length_chunks_is_the_cheapest_cut_and_keeps_every_example():
    import itertools

    rng = torch.Generator().manual_seed(3)
    for trial in range(40):
        n = int(torch.randint(1, 8, (1,), generator=rng))
        lengths = torch.randint(1, 40, (n,), generator=rng).tolist()
        examples = [([1] * k, 0) for k in lengths]
        cost = int(torch.randint(0, 30, (1,), generator=rng))
        runs = sft_batches.length_chunks(examples, cost)
        assert sorted(len(e[0]) for r in runs for e in r) == sorted(lengths)  # a partition
        got = sum(len(r) * max(len(e[0]) for e in r) + cost for r in runs)
        ordered = sorted(lengths)
        best = min(  # every cut of the sorted lengths into contiguous runs, by brute force
            sum((b - a) * ordered[b - 1] + cost for a, b in zip((0, *cuts), (*cuts, n)))
            for k in range(n) for cuts in itertools.combinations(range(1, n), k))
        assert got == best, (lengths, cost)
    assert sft_batches.length_chunks([([1] * 5, 0), ([1] * 60, 0)], cost=10) == [[([1] * 5, 0)], [([1] * 60, 0)]]
    assert len(sft_batches.length_chunks([([1] * 5, 0), ([1] * 6, 0)], cost=10)) == 1  # not worth a second pass


def test_a_batch_cut_by_length_has_the_gradient_of_the_whole_batch(gpt_policy):
    gpt_policy.train()
    batch = _batch(gpt_policy.tokenizer.vocab_size, 4, [(6, 4), (30, 9), (7, 5), (28, 6), (8, 4)], seed=1)
    runs = sft_batches.length_chunks(batch, cost=2)
    assert len(runs) == 2
    whole, g_whole = _loss_and_grads(gpt_policy, [batch], plain=True)
    cut, g_cut = _loss_and_grads(gpt_policy, runs, plain=False)
    assert cut == pytest.approx(whole, rel=1e-5)
    for a, b in zip(g_cut, g_whole):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_mixed_batches_ratio_epochs_and_seed():
    arith = [([i], 0) for i in range(10)]
    gsm = [([100 + i], 0) for i in range(3)]
    mb = sft_batches.MixedBatches(arith, gsm, batch_size=8, arith_fraction=0.75, seed=1)
    batches = [mb.next() for _ in range(5)]
    assert all(len(parts[0]) == 6 and len(parts[1]) == 2 for parts in batches)
    firsts = [e[0][0] for parts in batches for e in parts[0]]
    assert sorted(firsts[:10]) == list(range(10))  # one full epoch before any repeat
    again = sft_batches.MixedBatches(arith, gsm, batch_size=8, arith_fraction=0.75, seed=1)
    assert [again.next() for _ in range(5)] == batches
    assert sft_batches.MixedBatches(arith, [], 4, 0.5, 0).next() == [sft_batches.MixedBatches(arith, [], 4, 0.5, 0).next()[0]]
    assert len(sft_batches.MixedBatches(arith, [], 4, 0.5, 0).next()[0]) == 4  # one source: it fills the batch
    with pytest.raises(InputError, match="no training sequences"):
        sft_batches.MixedBatches([], [], 4, 0.5, 0)


# --------------------------------------------------------------------------- the stage

SMOKE_OVERRIDES = [f"data.gsm8k_source={GSM8K}", "sft.steps=24", "sft.log_every=4", "sft.eval_every=12",
                   "sft.batch_size=8", "sft.warmup_steps=4", "sft.lr=1e-2", "sft.eval_samples=8"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """data/ prepared once from the GSM8K fixture with the smoke params."""
    from pipeline.stages.prepare import run_prepare

    root = tmp_path_factory.mktemp("prepared")
    cwd = Path.cwd()
    try:
        os.chdir(root)
        run_prepare(load_config(REPO / "configs" / "smoke.yaml", SMOKE_OVERRIDES))
    finally:
        os.chdir(cwd)
    return root / "data"


@pytest.fixture
def workdir(prepared, tmp_path, monkeypatch):
    shutil.copytree(prepared, tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def smoke_config(*extra: str):
    return load_config(REPO / "configs" / "smoke.yaml", [*SMOKE_OVERRIDES, *extra])


def read_csv(path: Path) -> list[dict[str, str]]:
    header, *rows = path.read_text().splitlines()
    return [dict(zip(header.split(","), r.split(","))) for r in rows]


@pytest.mark.slow
def test_sft_loss_decreases_and_is_deterministic(workdir):
    from pipeline.train.checkpoint import load_extra_state, load_policy

    out = sft.run_sft(smoke_config())
    rows = read_csv(Path("plots/sft.csv"))
    assert [r["step"] for r in rows] == ["4", "8", "12", "16", "20", "24"]
    losses = [float(r["loss"]) for r in rows]
    assert losses[-1] < losses[0] - 0.5, losses
    assert rows[2]["val_loss"] and rows[2]["arith_accuracy"] and not rows[0]["val_loss"]
    assert out["val_loss"] == pytest.approx(float(rows[-1]["val_loss"]), rel=1e-5)
    assert 0.0 <= out["arith_accuracy"] <= 1.0
    state = load_extra_state("checkpoints/sft")
    assert state["stage"] == "sft" and state["step"] == 24
    weights = Path("checkpoints/sft/model.safetensors").read_bytes()
    policy = load_policy("checkpoints/sft", "cpu")
    assert policy.num_params() == out["num_params"]

    sft.run_sft(smoke_config())  # same seed, same data: the same weights, bit for bit (CPU)
    assert Path("checkpoints/sft/model.safetensors").read_bytes() == weights
    assert [float(r["loss"]) for r in read_csv(Path("plots/sft.csv"))] == losses


@pytest.mark.slow
def test_resume_states_change_no_bit_of_the_run(workdir):
    """Writing a resumable state (weights, AdamW, RNGs, batch order) at every step changes nothing the run
    computes: it ends with the weights and series of a run that writes none (experiments/plateau.py relies on it)."""
    sft.run_sft(smoke_config("sft.save_every=1000"))
    weights, series = Path("checkpoints/sft/model.safetensors").read_bytes(), Path("plots/sft.csv").read_text()
    shutil.rmtree("checkpoints")
    Path("plots/sft.csv").unlink()
    sft.run_sft(smoke_config("sft.save_every=1", "sft.keep_last=30"))
    assert Path("checkpoints/sft/model.safetensors").read_bytes() == weights
    assert Path("plots/sft.csv").read_text() == series


@pytest.mark.slow
def test_killed_sft_resumes_bit_identically(workdir, monkeypatch, caplog):
    """A run stopped right after its resume state at step 12 and run again ends with the weights
    and series of an uninterrupted run, bit for bit (CPU): weights, AdamW moments, torch RNG and the
    batch order all come back. A resume state from other params is ignored."""
    sft.run_sft(smoke_config("sft.save_every=6"))
    whole = Path("checkpoints/sft/model.safetensors").read_bytes()
    series = Path("plots/sft.csv").read_text()

    class Killed(Exception):
        pass

    real = sft.save_resume

    def save_then_die(folder, step, *a, **k):
        real(folder, step, *a, **k)
        if step == 12:
            raise Killed

    monkeypatch.setattr(sft, "save_resume", save_then_die)
    with pytest.raises(Killed):
        sft.run_sft(smoke_config("sft.save_every=6"))
    monkeypatch.setattr(sft, "save_resume", real)
    assert sorted(p.name for p in Path("checkpoints/sft.resume").iterdir()) == ["step_000006", "step_000012"]
    with caplog.at_level("INFO", logger="pipeline"):
        sft.run_sft(smoke_config("sft.save_every=6"))
    assert "resuming from checkpoints/sft.resume/step_000012" in caplog.text
    assert Path("checkpoints/sft/model.safetensors").read_bytes() == whole
    assert Path("plots/sft.csv").read_text() == series
    assert not Path("checkpoints/sft.resume").exists()

    monkeypatch.setattr(sft, "save_resume", save_then_die)
    with pytest.raises(Killed):
        sft.run_sft(smoke_config("sft.save_every=6"))
    monkeypatch.setattr(sft, "save_resume", real)
    caplog.clear()
    with caplog.at_level("INFO", logger="pipeline"):
        sft.run_sft(smoke_config("sft.save_every=6", "sft.lr=5e-3"))
    assert "ignoring resume state" in caplog.text and "resuming from" not in caplog.text


def test_non_finite_steps_are_skipped_counted_then_stop(workdir, monkeypatch):
    from pipeline.core.errors import TrainingDivergedError

    real = sft.response_nll
    calls = {"n": 0}

    def nan_on_third_step(policy, *a):
        calls["n"] += 1
        nll, n = real(policy, *a)
        return (nll * float("nan") if calls["n"] in (5, 6) else nll), n  # both parts of step 3

    monkeypatch.setattr(sft, "response_nll", nan_on_third_step)
    monkeypatch.setattr(sft, "length_chunks", lambda part: [part])  # one call per part: two per step
    out = sft.run_sft(smoke_config("sft.steps=4", "sft.eval_every=0", "sft.log_every=1"))
    assert out["skipped_steps"] == 1
    losses = [r["loss"] for r in read_csv(Path("plots/sft.csv"))]
    assert losses[2] == "nan" and all(x != "nan" for x in losses[:2] + losses[3:])
    monkeypatch.setattr(sft, "response_nll", lambda p, *a: (real(p, *a)[0] * float("nan"), 1))
    with pytest.raises(TrainingDivergedError, match="sft: 2 consecutive non-finite steps at step 2"):
        sft.run_sft(smoke_config("sft.steps=4", "sft.max_nonfinite=2"))


def test_skip_path_copies_an_init_checkpoint(workdir):
    from pipeline.train.checkpoint import load_extra_state, load_policy

    sft.run_sft(smoke_config("sft.steps=2", "sft.eval_samples=0"))
    shutil.move("checkpoints/sft", "base")
    out = sft.run_sft(smoke_config("model.init=base", "sft.steps=1000"))  # steps ignored: nothing trains
    assert out["skipped"] and out["checkpoint"] == "checkpoints/sft"
    base, copy = load_policy("base", "cpu"), load_policy("checkpoints/sft", "cpu")
    assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), copy.state_dict().values()))
    assert load_extra_state("checkpoints/sft") == {"stage": "sft", "skipped": True, "init": "base"}
    assert Path("plots/sft.csv").read_text() == "step,loss,val_loss,arith_accuracy\n"
    with pytest.raises(InputError, match="not a checkpoint folder"):
        sft.run_sft(smoke_config("model.init=data"))


def test_skip_path_saves_an_hf_model(workdir, hf_dirs):
    from pipeline.train.checkpoint import load_policy

    out = sft.run_sft(smoke_config("model.backend=hf", f"model.init={hf_dirs['gpt2']}"))
    assert out["skipped"]
    policy = load_policy("checkpoints/sft", "cpu")
    assert policy.backend == "hf"
    ids = torch.tensor([[5, 6, 7]])
    assert policy.logits(ids, torch.ones_like(ids)).shape[-1] >= policy.tokenizer.vocab_size


def test_missing_prepared_data_is_a_one_line_input_error(prepared, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match="tokenizer not found"):
        sft.run_sft(smoke_config())
    Path("data").mkdir()
    shutil.copy(prepared / "tokenizer.json", "data/tokenizer.json")
    with pytest.raises(InputError, match=r"arith_train.jsonl: not found \(run the 'prepare' stage first\)"):
        sft.run_sft(smoke_config())


# --------------------------------------------------------------------------- several processes (torchrun)

@settings(max_examples=150, deadline=None)
@given(parts=st.lists(st.lists(st.integers(1, 250), min_size=0, max_size=16), min_size=1, max_size=2),
       world=st.integers(2, 4))
def test_rank_shares_partition_the_batch_with_balanced_tokens(parts, world):
    """The ranks' shares are disjoint and together the whole batch (every source's part), and their
    token counts differ by at most the longest example (longest-first to the least-loaded rank)."""
    batch = [[([7] * n, 0) for n in lengths] for lengths in parts]
    shares = [sft_batches.rank_share(batch, r, world) for r in range(world)]
    assert sorted(id(e) for s in shares for e in s) == sorted(id(e) for part in batch for e in part)
    totals = [sum(len(ids) for ids, _ in s) for s in shares]
    longest = max((n for lengths in parts for n in lengths), default=0)
    assert max(totals) - min(totals) <= longest
    assert sft_batches.rank_share([[([1] * 9, 0), ([1] * 5, 0)], [([1] * 4, 0)]], 1, 2) == [([1] * 5, 0), ([1] * 4, 0)]


def _sft_cli(cwd: Path, *overrides: str, steps: int = 12):
    import subprocess
    import sys

    sets = [*SMOKE_OVERRIDES, f"sft.steps={steps}", "sft.eval_every=6", "sft.save_every=6", *overrides]
    cmd = [sys.executable, "-m", "pipeline", "sft", "--params", str(REPO / "configs" / "smoke.yaml"),
           *[x for o in sets for x in ("--set", o)]]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=300)


@pytest.mark.slow
def test_sft_under_torchrun_equals_one_process(prepared, tmp_path):
    """sft.nproc=2 (gloo): every rank takes half of each batch and the gradients are summed, so the
    weights after 12 steps equal one process's to float rounding, the logged losses and the sharded
    held-out checks agree, rank 0 alone writes the outputs and the resume states are cleaned up."""
    runs = {}
    for nproc in (1, 2):
        cwd = tmp_path / f"nproc{nproc}"
        shutil.copytree(prepared, cwd / "data")
        res = _sft_cli(cwd, f"sft.nproc={nproc}")
        assert res.returncode == 0, res.stderr[-3000:]
        runs[nproc] = cwd
    from tests.conftest import weights

    a, b = weights(runs[1] / "checkpoints" / "sft"), weights(runs[2] / "checkpoints" / "sft")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=2e-5)
    one, two = read_csv(runs[1] / "plots" / "sft.csv"), read_csv(runs[2] / "plots" / "sft.csv")
    assert [r["step"] for r in one] == [r["step"] for r in two] == ["4", "6", "8", "12"]
    for r1, r2 in zip(one, two):
        for col in ("loss", "val_loss"):
            if r1[col]:
                assert float(r2[col]) == pytest.approx(float(r1[col]), rel=1e-4), (col, r1, r2)
        if r1["arith_accuracy"]:  # 8 problems, 4 per rank, counted over both
            assert abs(float(r2["arith_accuracy"]) - float(r1["arith_accuracy"])) <= 1 / 8
    assert float(one[-1]["loss"]) < float(one[0]["loss"]) - 0.3  # it trained: 12 steps at lr 1e-2
    assert not (runs[2] / "checkpoints" / "sft.resume").exists()


@pytest.mark.slow
def test_sft_nproc_without_torchrun_is_an_input_error(prepared, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(prepared, tmp_path / "data")
    with pytest.raises(InputError, match=r"sft.nproc = 2 needs 2 processes: run the stage through"):
        sft.run_sft(smoke_config("sft.nproc=2"))


@pytest.mark.slow
def test_sft_under_torchrun_killed_resumes_bit_identically(prepared, tmp_path):
    """sft.nproc=2: SIGKILL the CLI, torchrun and both ranks after the step-6 resume state, re-run: the
    weights and series equal an uninterrupted 2-process run's, bit for bit (rank 0 wrote the state,
    every rank resumes from it)."""
    import sys

    from tests.conftest import kill_tree_at, weights

    ref, cwd = tmp_path / "uninterrupted", tmp_path / "killed"
    for d in (ref, cwd):
        shutil.copytree(prepared, d / "data")
    res = _sft_cli(ref, "sft.nproc=2", steps=18)
    assert res.returncode == 0, res.stderr[-3000:]

    sets = [*SMOKE_OVERRIDES, "sft.steps=18", "sft.eval_every=6", "sft.save_every=6", "sft.nproc=2"]
    cmd = [sys.executable, "-m", "pipeline", "sft", "--params", str(REPO / "configs" / "smoke.yaml"),
           *[x for o in sets for x in ("--set", o)]]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    kill_tree_at(cmd, cwd, env, cwd / "checkpoints" / "sft.resume" / "step_000006")
    assert not (cwd / "checkpoints" / "sft" / "model.safetensors").exists()
    res = _sft_cli(cwd, "sft.nproc=2", steps=18)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming from" in res.stderr
    a, b = weights(ref / "checkpoints" / "sft"), weights(cwd / "checkpoints" / "sft")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert (ref / "plots" / "sft.csv").read_text() == (cwd / "plots" / "sft.csv").read_text()
