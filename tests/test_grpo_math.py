"""GRPO math against hand-computed tensors and a plain per-token reference loop."""

import math

import pytest
import torch

from pipeline.rl.loss import aggregate, group_advantages, grpo_loss, informative_fraction, k3_kl
from pipeline.rl.masked import masked_mean


def test_group_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.2, 1.2, 0.2, 0.2])
    adv = group_advantages(r, group_size=4)
    # group 1: mean .25, unbiased std sqrt(((.75)^2 + 3*(.25)^2)/3) = 0.5
    s1 = 0.5 + 1e-4
    # group 2: mean .7, std sqrt((4 * .25)/3) = sqrt(1/3)
    s2 = math.sqrt(1 / 3) + 1e-4
    expected = torch.tensor([0.75 / s1, -0.25 / s1, -0.25 / s1, -0.25 / s1,
                             0.5 / s2, 0.5 / s2, -0.5 / s2, -0.5 / s2])
    torch.testing.assert_close(adv, expected)


def test_group_advantages_variants():
    r = torch.tensor([1.0, 0.0, 3.0, 3.0])
    torch.testing.assert_close(group_advantages(r, 2, norm="none"), torch.tensor([0.5, -0.5, 0.0, 0.0]))
    # batch norm: the group-centred values over the std of all rewards, [1, 0, 3, 3]: mean 1.75,
    # unbiased variance (0.5625 + 3.0625 + 1.5625 + 1.5625) / 3 = 2.25, std 1.5
    torch.testing.assert_close(group_advantages(r, 2, norm="batch"),
                               torch.tensor([0.5, -0.5, 0.0, 0.0]) / (1.5 + 1e-4))
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(r, 3)


def test_all_equal_group_gives_zero_advantage():
    r = torch.tensor([0.2, 0.2, 0.2, 0.2, 1.2, 1.2, 1.2, 1.2])
    assert torch.equal(group_advantages(r, 4), torch.zeros(8))
    assert informative_fraction(r, 4) == 0.0
    assert informative_fraction(torch.tensor([0.0, 1.0, 0.0, 0.0]), 2) == 0.5


def test_k3_hand_computed_and_nonnegative():
    new = torch.tensor([0.0, -1.0, -2.0])
    ref = torch.tensor([0.0, -2.0, -1.0])
    d = ref - new
    torch.testing.assert_close(k3_kl(new, ref), torch.exp(d) - d - 1)
    assert k3_kl(new, ref)[0].item() == 0.0
    torch.testing.assert_close(k3_kl(new, ref)[1], torch.tensor(math.exp(-1) + 1 - 1))
    x = torch.randn(1000) * 3
    assert (k3_kl(x, torch.randn(1000)) >= 0).all()


def _reference_loss(new, old, ref, adv, mask, clip, kl_coef):
    """The seed's loss written as a plain loop over tokens."""
    num, den = 0.0, 0.0
    for i in range(new.shape[0]):
        for t in range(new.shape[1]):
            if mask[i, t] == 0:
                continue
            ratio = torch.exp(new[i, t] - old[i, t])
            surr = torch.min(ratio * adv[i], torch.clamp(ratio, 1 - clip, 1 + clip) * adv[i])
            d = ref[i, t] - new[i, t]
            kl = torch.exp(d) - d - 1
            num = num + (surr - kl_coef * kl)
            den += 1.0
    return -num / den


def _batch(seed=0, n=6, t=7):
    g = torch.Generator().manual_seed(seed)
    new = (torch.randn(n, t, generator=g) * 0.3 - 1.0)
    old = new + torch.randn(n, t, generator=g) * 0.3
    ref = new + torch.randn(n, t, generator=g) * 0.3
    adv = torch.randn(n, generator=g)
    mask = (torch.rand(n, t, generator=g) > 0.3).float()
    mask[0] = 0  # one sequence with no response tokens
    return new, old, ref, adv, mask


def test_loss_and_gradient_match_reference_loop():
    new, old, ref, adv, mask = _batch()
    a = new.clone().requires_grad_(True)
    loss, stats = grpo_loss(a, old, ref, adv, mask, clip=0.2, kl_coef=0.04)
    loss.backward()
    b = new.clone().requires_grad_(True)
    ref_loss = _reference_loss(b, old, ref, adv, mask, 0.2, 0.04)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(a.grad, b.grad)
    assert a.grad[mask == 0].abs().max() == 0
    ratio = torch.exp(new - old)
    assert stats["clipfrac"] == pytest.approx(masked_mean(((ratio - 1).abs() > 0.2).float(), mask).item())
    assert stats["kl"] == pytest.approx(masked_mean(k3_kl(new, ref), mask).item(), rel=1e-6)


def test_loss_hand_computed_single_token():
    # ratio = e^0.5 > 1.2 with A = 1: the clipped branch wins, surrogate = 1.2
    new = torch.tensor([[0.0, -0.5]])
    old = torch.tensor([[0.0, -1.0]])
    ref = torch.tensor([[0.0, -0.5]])  # KL 0 on the response token
    mask = torch.tensor([[0.0, 1.0]])
    loss, stats = grpo_loss(new, old, ref, torch.tensor([1.0]), mask)
    assert loss.item() == pytest.approx(-1.2)
    assert stats["clipfrac"] == 1.0 and stats["clipfrac_high"] == 1.0 and stats["kl"] == 0.0


def test_clipped_surrogate_all_four_sign_and_side_cases():
    """One token per row, kl 0, ratios 0.5 / 1.5 / 0.5 / 1.5 with A = -1 / -1 / +1 / +1, clip 0.2:
      A<0, r=0.5: min(-0.5, -0.8) = -0.8, clipped (constant): gradient 0
      A<0, r=1.5: min(-1.5, -1.2) = -1.5, unclipped: d(r*A)/dlogp = r*A = -1.5
      A>0, r=0.5: min(0.5, 0.8) = 0.5, unclipped: r*A = 0.5
      A>0, r=1.5: min(1.5, 1.2) = 1.2, clipped: gradient 0
    loss = -mean = -(-0.8 - 1.5 + 0.5 + 1.2) / 4 = 0.15; d loss / d logp = -(r*A)/4 where unclipped."""
    new = torch.tensor([[0.5], [1.5], [0.5], [1.5]]).log().requires_grad_(True)
    old = torch.zeros(4, 1)
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0])
    loss, st = grpo_loss(new, old, None, adv, torch.ones(4, 1), clip=0.2, kl_coef=0.0)
    loss.backward()
    assert loss.item() == pytest.approx(0.15)
    torch.testing.assert_close(new.grad, torch.tensor([[0.0], [0.375], [-0.125], [0.0]]))
    # the clip binds on the first (low side, A<0) and the last (high side, A>0) row
    assert st["clipfrac_low"].item() == pytest.approx(1 / 4)
    assert st["clipfrac_high"].item() == pytest.approx(1 / 4)
    assert st["clipfrac"].item() == 1.0  # every ratio is outside [0.8, 1.2]


def test_zero_advantage_gives_zero_policy_gradient():
    new, old, ref, _, mask = _batch(1)
    a = new.clone().requires_grad_(True)
    loss, _ = grpo_loss(a, old, ref, torch.zeros(new.shape[0]), mask, kl_coef=0.0)
    loss.backward()
    assert loss.item() == 0.0
    assert a.grad.abs().max().item() == 0.0


def test_clip_high_is_asymmetric():
    new = torch.tensor([[math.log(1.25)], [math.log(1.25)]])
    old = torch.zeros(2, 1)
    mask = torch.ones(2, 1)
    adv = torch.tensor([1.0, 1.0])
    sym, _ = grpo_loss(new, old, None, adv, mask, clip=0.2, kl_coef=0.0)
    high, st = grpo_loss(new, old, None, adv, mask, clip=0.2, clip_high=0.28, kl_coef=0.0)
    assert sym.item() == pytest.approx(-1.2)
    assert high.item() == pytest.approx(-1.25)
    assert st["clipfrac_high"] == 0.0


def test_clipfrac_counts_the_asymmetric_band_when_clip_high_is_set():
    """Ratios 0.7, 0.9, 1.1, 1.25, 1.3 with clip 0.2 / clip_high 0.28: outside [0.8, 1.28] are 0.7 and
    1.3 (2 of 5); the symmetric band [0.8, 1.2] would also count 1.25 (3 of 5)."""
    ratios = torch.tensor([[0.7, 0.9, 1.1, 1.25, 1.3]])
    new, old = ratios.log(), torch.zeros(1, 5)
    mask = torch.ones(1, 5)
    adv = torch.tensor([1.0])
    _, st = grpo_loss(new, old, None, adv, mask, clip=0.2, clip_high=0.28, kl_coef=0.0)
    assert st["clipfrac"].item() == pytest.approx(2 / 5)
    assert st["clipfrac_high"].item() == pytest.approx(1 / 5)  # 1.3 with A > 0
    assert st["clipfrac_low"].item() == 0.0  # 0.7 is below, but A > 0: the clip does not bind
    _, sym = grpo_loss(new, old, None, adv, mask, clip=0.2, kl_coef=0.0)
    assert sym["clipfrac"].item() == pytest.approx(3 / 5)
    _, neg = grpo_loss(new, old, None, -adv, mask, clip=0.2, clip_high=0.28, kl_coef=0.0)
    assert neg["clipfrac_low"].item() == pytest.approx(1 / 5) and neg["clipfrac_high"].item() == 0.0


def test_loss_statistics_stay_tensors_on_the_loss_device():
    """No `.item()` inside grpo_loss: every statistic is a 0-d tensor (one host sync per value would
    otherwise stall the GPU once per minibatch); the caller converts them when it logs."""
    new, old, ref, adv, mask = _batch()
    _, stats = grpo_loss(new, old, ref, adv, mask)
    assert set(stats) == {"kl", "clipfrac", "clipfrac_low", "clipfrac_high", "ratio_mean"}
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and v.device == new.device for v in stats.values())


def test_aggregations_hand_computed():
    """Masked cells hold large values (a pad token's surrogate is not 0 in a real batch) and the third
    row has no response tokens: dropping the mask from any sum, or counting the empty row as a
    sequence in the per-sequence mean, changes the result."""
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [7.0, 7.0, 7.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert aggregate(x, m, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(x, m, "seq-mean-token-mean").item() == pytest.approx((2.0 + 4.0) / 2)
    # Dr. GRPO divides by every sequence (3) times the generation budget (5)
    assert aggregate(x, m, "seq-mean-token-sum-norm", max_len=5).item() == pytest.approx(10 / (3 * 5))
    assert aggregate(x, m, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (3 * 3))
    with pytest.raises(ValueError, match="allowed"):
        aggregate(x, m, "bogus")


def test_sequence_importance_uses_length_normalised_ratio():
    # the masked first position carries a log-ratio of +5: it must not enter the sequence's mean
    new = torch.tensor([[0.0, -1.0, -1.0]])
    old = torch.tensor([[-5.0, -1.2, -1.4]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    loss, st = grpo_loss(new, old, None, torch.tensor([1.0]), mask, clip=0.5, kl_coef=0.0, importance="sequence")
    s = math.exp((0.2 + 0.4) / 2)
    assert loss.item() == pytest.approx(-s)
    assert st["ratio_mean"] == pytest.approx(s)


def test_kl_requires_reference():
    new, old, _, adv, mask = _batch()
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(new, old, None, adv, mask, kl_coef=0.04)
