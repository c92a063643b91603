"""Unit tests for qerl.losses against numbers worked out by hand (arithmetic in the comments)."""

import math

import pytest
import torch
from torch.testing import assert_close

from qerl.logprobs import entropy_from_logits, selective_log_softmax
from qerl.losses import (
    high_entropy_mask,
    aggregate_loss,
    group_advantages,
    groups_with_signal,
    K3_KL_CAP,
    k3_kl,
    kl_penalty,
    masked_mean,
    overlong_penalty,
    policy_loss,
    truncated_is_weights,
)

F64 = torch.float64


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


# ------------------------------------------------------------------------------------------------
# masked_mean


def test_masked_mean_ignores_padding_and_empty_rows():
    x = t([[1.0, 2.0, float("nan")], [4.0, float("inf"), 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # all: (1 + 2 + 4) / 3 = 7/3; per row: 3/2 = 1.5, 4/1 = 4
    assert_close(masked_mean(x, mask), t(7.0 / 3.0))
    assert_close(masked_mean(x, mask, dim=-1), t([1.5, 4.0]))
    # an all-padding row averages to 0, not NaN
    assert_close(masked_mean(x, torch.zeros_like(mask), dim=-1), t([0.0, 0.0]))


# ------------------------------------------------------------------------------------------------
# group_advantages / groups_with_signal

# Two groups of G=3: [0, 3, 6] and [2, 2, 2].
REWARDS = [0.0, 3.0, 6.0, 2.0, 2.0, 2.0]


def test_advantages_group_scale():
    # group 0: mean 3, deviations [-3, 0, 3], unbiased var (9 + 0 + 9) / 2 = 9, std 3 -> [-1, 0, 1]
    # group 1: all equal -> deviations 0, std 0 -> 0 / (0 + eps) = 0
    # (with eps = 0 only the first group: 0 / 0 would be NaN; the eps is what makes it 0)
    adv = group_advantages(t(REWARDS[:3], torch.float32), 3, "group", eps=0.0)
    assert_close(adv, torch.tensor([-1.0, 0.0, 1.0]))
    # default eps 1e-4 (TRL): 3 / 3.0001 = 0.99996667
    adv = group_advantages(t(REWARDS, torch.float32), 3)
    assert_close(adv, torch.tensor([-3 / 3.0001, 0.0, 3 / 3.0001, 0.0, 0.0, 0.0]))


def test_advantages_batch_scale():
    # whole-batch mean 15/6 = 2.5; squared deviations 6.25 + .25 + 12.25 + 3 * .25 = 19.5
    # unbiased var 19.5 / 5 = 3.9 -> std sqrt(3.9) = 1.9748; numerators are still the group deviations
    adv = group_advantages(t(REWARDS, torch.float32), 3, "batch", eps=0.0)
    s = math.sqrt(3.9)
    assert_close(adv, torch.tensor([-3 / s, 0.0, 3 / s, 0.0, 0.0, 0.0]))
    # DDP: the std of every rank's rewards (here this rank's plus another's (W, N) = (2, 6) gather)
    everyone = torch.stack([t(REWARDS, torch.float32), torch.zeros(6)])
    adv = group_advantages(t(REWARDS, torch.float32), 3, "batch", eps=0.0, batch_rewards=everyone)
    s = everyone.reshape(-1).std().item()  # 12 rewards: mean 1.25, sum of squares 57
    assert abs(s - math.sqrt((57 - 12 * 1.25 ** 2) / 11)) < 1e-6
    assert_close(adv, torch.tensor([-3 / s, 0.0, 3 / s, 0.0, 0.0, 0.0]))


def test_advantages_no_scale():
    adv = group_advantages(t(REWARDS, torch.float32), 3, "none")
    assert_close(adv, torch.tensor([-3.0, 0.0, 3.0, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_constant_rewards_are_zero_not_nan(scale):
    adv = group_advantages(torch.full((8,), 5.0), 4, scale)
    assert torch.isfinite(adv).all() and (adv == 0).all()
    # G = 1: unbiased std of one sample is undefined; we take it as 0, so advantage 0
    adv = group_advantages(torch.tensor([1.0, 2.0]), 1, scale if scale != "batch" else "group")
    assert (adv == 0).all()


@pytest.mark.parametrize("value,G", [(0.7, 16), (0.1, 7), (1 / 3, 5)])
def test_advantages_of_equal_non_dyadic_rewards_are_exactly_zero(value, G):
    """A group of equal rewards like 0.7 (not a sum of powers of two): an fp32 mean an ulp off would
    give every sample the same ~6e-4 advantage after the division by std + 1e-4."""
    for scale in ("group", "none"):
        assert (group_advantages(torch.full((2 * G,), value), G, scale) == 0).all()


def test_advantages_validates_input():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(4), 2, "bogus")


def test_groups_with_signal():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    assert groups_with_signal(rewards, 2).tolist() == [False, True, False]


# ------------------------------------------------------------------------------------------------
# k3


def test_k3_matches_formula_and_is_nonnegative():
    lp, ref = t([[-1.0, -2.0, -0.3]]), t([[-1.5, -1.0, -0.3]])
    # ref - lp = [-0.5, 1.0, 0]:  e^-0.5 + 0.5 - 1 = 0.10653066;  e^1 - 1 - 1 = 0.71828183;  0
    assert_close(k3_kl(lp, ref), t([[0.10653066, 0.71828183, 0.0]]))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)
    assert (k3_kl(a, b) >= 0).all()


def test_kl_estimators_values_and_gradients():
    # lp - ref = [0.5, -1.0]: k1 = [0.5, -1], k2 = [0.125, 0.5], k3 = e^-0.5 + 0.5 - 1, e^1 - 1 - 1
    # d/dlp: k1 1, k2 (lp - ref) = [0.5, -1], k3 1 - e^(ref - lp) = [0.39346934, -1.71828183]
    ref = t([[-1.5, -1.0]])
    for estimator, value, grad in [("k1", [0.5, -1.0], [1.0, 1.0]), ("k2", [0.125, 0.5], [0.5, -1.0]),
                                   ("k3", [0.10653066, 0.71828183], [0.39346934, -1.71828183])]:
        lp = t([[-1.0, -2.0]]).requires_grad_()
        kl = kl_penalty(lp, ref, estimator)
        assert_close(kl, t([value]))
        kl.sum().backward()
        assert_close(lp.grad, t([grad]))
    with pytest.raises(ValueError, match="estimator must be"):
        kl_penalty(lp, ref, "k4")


def test_k3_is_capped_so_one_far_token_does_not_make_the_loss_inf():
    # ref - lp = 93 nats: exp overflows fp32 (inf) without the cap; the capped token has no gradient,
    # the ordinary one keeps its own: d k3 / d lp = 1 - exp(ref - lp) = 1 - e^-0.5 = 0.39346934
    lp = t([[-95.0, -1.0]]).requires_grad_()
    ref = t([[-2.0, -1.5]])
    kl = k3_kl(lp, ref)
    assert_close(kl, t([[K3_KL_CAP, 0.10653066]]))
    kl.sum().backward()
    assert_close(lp.grad, t([[0.0, 0.39346934]]))


def test_k3_far_below_the_reference_follows_verl_low_var_kl():
    # ref - lp = -10.5: k3 = e^-10.5 + 10.5 - 1 = 9.5000275 (under the cap, gradient 1 - e^-10.5);
    # ref - lp = -30: the log-ratio is clamped at -20 and the value capped at 10, as verl's low_var_kl
    lp = t([[-1.0, -1.0]]).requires_grad_()
    ref = t([[-11.5, -31.0]])
    kl = k3_kl(lp, ref)
    assert_close(kl, t([[math.exp(-10.5) + 9.5, K3_KL_CAP]]))
    kl.sum().backward()
    assert_close(lp.grad, t([[1 - math.exp(-10.5), 0.0]]))


# ------------------------------------------------------------------------------------------------
# truncated_is_weights

# log(old / sampler) per token; row 1's last slot is padding with garbage (sampler -inf).
OLD = t([[1.0, -0.5, 0.3], [0.2, -0.1, 50.0]])
SAMPLER = t([[0.0, 0.0, 0.0], [0.0, 0.0, float("-inf")]])
IS_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
E = math.exp


def test_is_weights_token_level():
    # ratios e^1 = 2.718 (> cap 2), e^-0.5 = 0.6065, e^0.3 = 1.3499; e^0.2 = 1.2214, e^-0.1 = 0.9048
    w = truncated_is_weights(OLD, SAMPLER, IS_MASK, "token", "truncate", cap=2.0)
    assert_close(w, t([[2.0, E(-0.5), E(0.3)], [E(0.2), E(-0.1), 0.0]], torch.float32))
    w = truncated_is_weights(OLD, SAMPLER, IS_MASK, "token", "mask", cap=2.0)
    assert_close(w, t([[0.0, E(-0.5), E(0.3)], [E(0.2), E(-0.1), 0.0]], torch.float32))


def test_is_weights_sequence_level():
    # row 0: sum 1 - 0.5 + 0.3 = 0.8, e^0.8 = 2.2255 > 2 -> truncate: 2 everywhere; mask: 0 everywhere
    # row 1: sum 0.2 - 0.1 = 0.1 (padding ignored), e^0.1 = 1.1052 on both valid tokens, 0 on pad
    w = truncated_is_weights(OLD, SAMPLER, IS_MASK, "sequence", "truncate", cap=2.0)
    assert_close(w, t([[2.0, 2.0, 2.0], [E(0.1), E(0.1), 0.0]], torch.float32))
    w = truncated_is_weights(OLD, SAMPLER, IS_MASK, "sequence", "mask", cap=2.0)
    assert_close(w, t([[0.0, 0.0, 0.0], [E(0.1), E(0.1), 0.0]], torch.float32))


def test_is_weights_geometric_level():
    # row 0: mean (1 - 0.5 + 0.3) / 3 = 0.2667, e^0.2667 = 1.3056; row 1: (0.2 - 0.1) / 2 = 0.05 (padding
    # ignored in the sum and the count), e^0.05 = 1.0513
    w = truncated_is_weights(OLD, SAMPLER, IS_MASK, "geometric", "truncate", cap=2.0)
    assert_close(w, t([[E(0.8 / 3)] * 3, [E(0.05), E(0.05), 0.0]], torch.float32))
    w = truncated_is_weights(OLD, SAMPLER, IS_MASK, "geometric", "mask", cap=1.1)  # 1.3056 > 1.1 > 1.0513
    assert_close(w, t([[0.0] * 3, [E(0.05), E(0.05), 0.0]], torch.float32))
    w = truncated_is_weights(OLD, SAMPLER, IS_MASK, "geometric", "truncate", cap=1.1)
    assert_close(w, t([[1.1] * 3, [E(0.05), E(0.05), 0.0]], torch.float32))


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_a_nan_sampler_log_prob_drops_its_token_or_sequence_not_the_batch(mode):
    sampler = SAMPLER.clone()
    sampler[1, 0] = float("nan")  # (row 1, token 0): no log-prob from the engine
    token = truncated_is_weights(OLD, sampler, IS_MASK, "token", mode, cap=2.0)
    assert token[1].tolist() == pytest.approx([0.0, E(-0.1), 0.0]) and torch.isfinite(token).all()
    assert_close(token[0], truncated_is_weights(OLD, SAMPLER, IS_MASK, "token", mode, cap=2.0)[0])
    for level in ("sequence", "geometric"):
        w = truncated_is_weights(OLD, sampler, IS_MASK, level, mode, cap=2.0)
        assert w[1].tolist() == [0.0, 0.0, 0.0] and torch.isfinite(w).all()


def test_is_weights_detached_and_overflow_safe():
    old = torch.full((1, 200), 5.0, requires_grad=True)  # sequence log-ratio 1000: e^1000 = inf
    w = truncated_is_weights(old, torch.zeros(1, 200), torch.ones(1, 200), "sequence", "truncate", cap=3.0)
    assert not w.requires_grad
    assert_close(w, torch.full((1, 200), 3.0))


# ------------------------------------------------------------------------------------------------
# aggregate_loss

# Ragged batch: row 0 has 4 valid tokens, row 1 has 2; padding holds 100 to catch leaks.
PER_TOKEN = t([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 100.0, 100.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
# valid sum = (1+2+3+4) + (5+6) = 21 over 6 tokens


def test_aggregate_grpo():
    # sequence means 10/4 = 2.5 and 11/2 = 5.5 -> mean 4.0; with 4 sequences in the full batch: 8/4 = 2
    assert_close(aggregate_loss(PER_TOKEN, MASK, "grpo"), t(4.0))
    assert_close(aggregate_loss(PER_TOKEN, MASK, "grpo", num_sequences_total=4), t(2.0))


def test_aggregate_bnpo_dapo():
    # bnpo: 21 / 6 = 3.5; dapo without a total = the same; dapo with 12 tokens in the batch: 21/12
    assert_close(aggregate_loss(PER_TOKEN, MASK, "bnpo"), t(3.5))
    assert_close(aggregate_loss(PER_TOKEN, MASK, "dapo"), t(3.5))
    assert_close(aggregate_loss(PER_TOKEN, MASK, "dapo", num_tokens_total=12), t(1.75))
    # the trainer's count is an (all-reduced) tensor: the same value, clamped on the device
    assert_close(aggregate_loss(PER_TOKEN, MASK, "dapo", num_tokens_total=torch.tensor(12.0)), t(1.75))
    assert_close(aggregate_loss(PER_TOKEN, MASK, "dapo", num_tokens_total=torch.tensor(0.0)), t(21.0))


def test_aggregate_dr_grpo():
    # 21 / (2 sequences * 4) = 2.625; with L = 5: 21 / 10 = 2.1; with 4 sequences, L = 4: 21 / 16
    assert_close(aggregate_loss(PER_TOKEN, MASK, "dr_grpo", max_completion_length=4), t(2.625))
    assert_close(aggregate_loss(PER_TOKEN, MASK, "dr_grpo", max_completion_length=5), t(2.1))
    got = aggregate_loss(PER_TOKEN, MASK, "dr_grpo", max_completion_length=4, num_sequences_total=4)
    assert_close(got, t(21 / 16))
    with pytest.raises(ValueError):
        aggregate_loss(PER_TOKEN, MASK, "dr_grpo")
    with pytest.raises(ValueError):
        aggregate_loss(PER_TOKEN, MASK, "bogus")


def test_micro_batches_sum_to_full_batch():
    # full batch of 4 sequences with 4 + 2 + 1 + 3 = 10 valid tokens
    # valid sums: 10, 11, 7, 1.5 -> 29.5;  sequence means 2.5, 5.5, 7, 0.5 -> 15.5
    full = t([[1, 2, 3, 4], [5, 6, 9, 9], [7, 9, 9, 9], [0.5, 0.5, 0.5, 9]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])
    micro = [(full[:2], mask[:2]), (full[2:], mask[2:])]  # valid sums 21 and 8.5

    def total(mode, **kw):
        return sum(aggregate_loss(x, m, mode, **kw) for x, m in micro)

    # dapo: 29.5 / 10 = 2.95 = 21/10 + 8.5/10
    assert_close(aggregate_loss(full, mask, "dapo"), t(2.95))
    assert_close(total("dapo", num_tokens_total=10), t(2.95))
    # dr_grpo: 29.5 / (4 * 4) = 1.84375 = 21/16 + 8.5/16
    assert_close(aggregate_loss(full, mask, "dr_grpo", max_completion_length=4), t(1.84375))
    assert_close(total("dr_grpo", max_completion_length=4, num_sequences_total=4), t(1.84375))
    # grpo: 15.5 / 4 = 3.875 = (2.5 + 5.5)/4 + (7 + 0.5)/4
    assert_close(aggregate_loss(full, mask, "grpo"), t(3.875))
    assert_close(total("grpo", num_sequences_total=4), t(3.875))
    # bnpo is a local token mean: (21/6 + 8.5/4) / 2 = (3.5 + 2.125) / 2 = 2.8125 != 2.95
    assert_close(total("bnpo") / 2, t(2.8125))


# ------------------------------------------------------------------------------------------------
# policy_loss

# seq 0 (A = +1): ratios [1.5, 1.0];  seq 1 (A = -1): ratios [0.5, 1.5];  third slot is padding.
RATIOS = [[1.5, 1.0, 1.0], [0.5, 1.5, 1.0]]
ADV = t([1.0, -1.0])
PL_MASK = torch.tensor([[1, 1, 0], [1, 1, 0]])


def clipped_case():
    old = t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    logprobs = torch.log(t(RATIOS)).requires_grad_()
    return logprobs, old


def test_policy_loss_clipping_values_and_metrics():
    logprobs, old = clipped_case()
    loss, m = policy_loss(logprobs, old, ADV, PL_MASK, clip_low=0.2, clip_high=0.28, aggregation="bnpo")
    # r=1.5, A=+1: -min(1.5, 1.28) = -1.28 (high clip active)
    # r=1.0, A=+1: -1.0
    # r=0.5, A=-1: -min(-0.5, 0.8 * -1) = 0.8 (low clip active)
    # r=1.5, A=-1: -min(-1.5, -1.28) = 1.5 (unclipped: the pessimistic side)
    # bnpo: (-1.28 - 1.0 + 0.8 + 1.5) / 4 = 0.02 / 4 = 0.005
    assert_close(loss, t(0.005))
    assert_close(m["clip_ratio/high"], t(0.25, torch.float32))
    assert_close(m["clip_ratio/low"], t(0.25, torch.float32))
    assert_close(m["clip_ratio/region"], t(0.5, torch.float32))
    assert_close(m["ratio/mean"], t(4.5 / 4, torch.float32))  # (1.5 + 1 + 0.5 + 1.5) / 4
    assert_close(m["kl"], t(0.0, torch.float32))
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())
    # grpo: sequence means (-2.28)/2 = -1.14 and 2.3/2 = 1.15 -> mean 0.005 (equal lengths here)
    loss, _ = policy_loss(logprobs, old, ADV, PL_MASK, clip_low=0.2, clip_high=0.28)
    assert_close(loss, t(0.005))


def test_policy_loss_clipped_tokens_have_zero_gradient():
    logprobs, old = clipped_case()
    loss, _ = policy_loss(logprobs, old, ADV, PL_MASK, clip_low=0.2, clip_high=0.28, aggregation="bnpo")
    loss.backward()
    # unclipped token loss = -r * A, d/dlogprob = -r * A (since dr/dlogprob = r), / 4 tokens:
    # (0,1): -1.0 * 1 / 4 = -0.25;  (1,1): -1.5 * -1 / 4 = 0.375;  clipped tokens and padding: 0
    assert_close(logprobs.grad, t([[0.0, -0.25, 0.0], [0.0, 0.375, 0.0]]))


def test_policy_loss_dual_clip_caps_negative_advantages_only():
    logprobs, old = clipped_case()
    # c = 1.4: the r=1.5, A=-1 token's 1.5 becomes 1.4 (and loses its gradient); the A > 0 tokens and
    # the low-clipped r=0.5 token (0.8 < 1.4) are as without the dual clip
    loss, m = policy_loss(logprobs, old, ADV, PL_MASK, clip_low=0.2, clip_high=0.28, dual_clip=1.4,
                          aggregation="bnpo")
    assert_close(loss, t((-1.28 - 1.0 + 0.8 + 1.4) / 4))
    assert_close(m["clip_ratio/dual"], t(0.25, torch.float32))
    loss.backward()
    assert_close(logprobs.grad, t([[0.0, -0.25, 0.0], [0.0, 0.0, 0.0]]))
    # c above every ratio: the plain surrogate, nothing counted
    loss, m = policy_loss(logprobs, old, ADV, PL_MASK, clip_low=0.2, clip_high=0.28, dual_clip=3.0,
                          aggregation="bnpo")
    assert_close(loss, t(0.005))
    assert_close(m["clip_ratio/dual"], t(0.0, torch.float32))


def test_policy_loss_is_weights_and_kl():
    logprobs, old = clipped_case()
    w = t([[2.0, 0.5, 7.0], [1.0, 0.0, 7.0]])
    loss, _ = policy_loss(logprobs, old, ADV, PL_MASK, clip_high=0.28, aggregation="bnpo", is_weights=w)
    # (-1.28 * 2 - 1.0 * 0.5 + 0.8 * 1 + 1.5 * 0) / 4 = (-2.56 - 0.5 + 0.8) / 4 = -0.565
    assert_close(loss, t(-0.565))

    # A = 0 leaves only the KL term. ref - lp = [-0.5, 1.0] -> k3 = [0.10653066, 0.71828183]
    lp, ref = t([[-1.0, -2.0]]).requires_grad_(), t([[-1.5, -1.0]])
    mask = torch.ones(1, 2)
    kl_mean = (0.10653066 + 0.71828183) / 2  # 0.41240625
    loss, m = policy_loss(lp, None, t([0.0]), mask, aggregation="bnpo", ref_logprobs=ref, kl_coef=0.1)
    assert_close(loss, t(0.1 * kl_mean))
    assert_close(m["kl"], t(kl_mean, torch.float32))
    # the IS weights scale the surrogate only, not the KL term
    loss, _ = policy_loss(lp, None, t([0.0]), mask, aggregation="bnpo", ref_logprobs=ref, kl_coef=0.1,
                          is_weights=t([[2.0, 0.5]]))
    assert_close(loss, t(0.1 * kl_mean))
    # kl_coef 0: not in the loss, still logged
    loss, m = policy_loss(lp, None, t([0.0]), mask, aggregation="bnpo", ref_logprobs=ref)
    assert_close(loss, t(0.0))
    assert_close(m["kl"], t(kl_mean, torch.float32))


def test_policy_loss_sequence_ratio_gspo():
    """GSPO: s_i = exp(mean_t (lp - old)) over the valid tokens, shared by the sequence's tokens."""
    lp = t([[-1.0, -2.0, -0.5], [-0.2, -0.4, -9.0]]).requires_grad_()
    old = t([[-1.1, -2.1, -0.5], [-0.2, -0.5, 0.0]])
    mask = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])                     # row 1: 2 valid tokens
    s0, s1 = math.exp((0.1 + 0.1 + 0.0) / 3), math.exp((0.0 + 0.1) / 2)  # 1.0689, 1.0513
    adv = t([1.0, -1.0])
    # wide clip: loss (grpo) = mean over sequences of -s_i * A_i
    loss, m = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, ratio_level="sequence")
    assert_close(loss, t((-s0 + s1) / 2))
    assert_close(m["ratio/mean"], t((3 * s0 + 2 * s1) / 5, torch.float32))
    loss.backward()
    # d loss / d lp_t = -A_i * s_i / |y_i| / N on valid tokens, 0 on padding
    assert_close(lp.grad, t([[-s0 / 3 / 2] * 3, [s1 / 2 / 2, s1 / 2 / 2, 0.0]]))
    # GSPO's tight clip (3e-4 / 4e-4): both sequences are outside it -- row 0 above 1 + 4e-4 with
    # A > 0, row 1 above with A < 0 (the lower clip does not bind there) -> row 0 has no gradient
    lp.grad = None
    loss, m = policy_loss(lp, old, adv, mask, clip_low=3e-4, clip_high=4e-4, ratio_level="sequence")
    loss.backward()
    assert_close(lp.grad[0], t([0.0, 0.0, 0.0]))
    assert lp.grad[1, :2].abs().min() > 0
    assert_close(m["clip_ratio/high"], t(3 / 5, torch.float32))
    with pytest.raises(ValueError, match="ratio_level"):
        policy_loss(lp, old, adv, mask, ratio_level="group")


def test_policy_loss_sequence_equals_token_on_policy():
    """On policy (ratio 1) with grpo aggregation, GSPO's gradient equals GRPO's token-level one."""
    lp = t([[-0.3, -1.2, -0.8], [-0.5, -0.9, -2.0]])
    mask = t([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = t([0.7, -1.3])
    grads = []
    for level in ("token", "sequence"):
        x = lp.clone().requires_grad_()
        loss, _ = policy_loss(x, None, adv, mask, ratio_level=level)
        loss.backward()
        grads.append((loss.detach(), x.grad))
    assert_close(grads[0][0], grads[1][0])
    assert_close(grads[0][1], grads[1][1])


def test_policy_loss_entropy_bonus():
    """A = 0 leaves only -entropy_coef * H, aggregated like the loss; its gradient raises the entropy."""
    logits = t([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.5]]]).requires_grad_()          # (1, T=2, V=3)
    H = entropy_from_logits(logits)                                                # (1, 2), with grad
    lp = t([[-0.3, -1.1]]).requires_grad_()
    mask = torch.ones(1, 2)
    loss, _ = policy_loss(lp, None, t([0.0]), mask, aggregation="bnpo", entropy=H, entropy_coef=0.1)
    assert_close(loss, -0.1 * H.detach().mean())
    loss.backward()
    # one gradient-descent step on the logits raises the (non-maximal) entropy of position 0 ...
    with torch.no_grad():
        assert entropy_from_logits(logits - 0.5 * logits.grad)[0, 0] > H[0, 0]
    # ... and does nothing at position 1, already uniform (entropy at its maximum, zero gradient)
    assert logits.grad[0, 1].abs().max() < 1e-6
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(lp, None, t([0.0]), mask, entropy_coef=0.1)
    # entropy_coef 0: the entropy is not in the loss even when passed
    loss0, _ = policy_loss(lp, None, t([0.0]), mask, aggregation="bnpo", entropy=H)
    assert_close(loss0, t(0.0))


def test_policy_loss_on_policy_gradient():
    # old_logprobs=None: ratio is 1 but d ratio / d logprob = 1, so grad = -A / num_tokens
    lp = t([[-0.7, -1.2]]).requires_grad_()
    loss, m = policy_loss(lp, None, t([2.0]), torch.ones(1, 2), aggregation="bnpo")
    assert_close(loss, t(-2.0))
    loss.backward()
    assert_close(lp.grad, t([[-1.0, -1.0]]))
    assert_close(m["ratio/mean"], t(1.0, torch.float32))


# ------------------------------------------------------------------------------------------------
# overlong_penalty


def test_overlong_penalty():
    # max 20, buffer 4 -> free up to 16, then -(len - 16) / 4, floored at -1 from 20 on
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    assert_close(overlong_penalty(lengths, 20, 4), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    assert_close(overlong_penalty(lengths, 20, 4, 2.0), torch.tensor([0.0, 0.0, -0.5, -1.0, -2.0, -2.0]))
    with pytest.raises(ValueError):
        overlong_penalty(lengths, 20, 0)


# ------------------------------------------------------------------------------------------------
# entropy_from_logits / selective_log_softmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_uniform_is_log_v(dtype):
    h = entropy_from_logits(torch.zeros(2, 3, 7, dtype=dtype), chunk_size=4)
    assert h.shape == (2, 3) and h.dtype == torch.float32
    assert_close(h, torch.full((2, 3), math.log(7)))


def test_entropy_hand_values():
    # p = [1/4, 3/4]: H = 0.25 ln 4 + 0.75 ln(4/3) = 0.34657359 + 0.21576155 = 0.56233514
    # [0, -inf]: one-hot -> H = 0 (not NaN)
    logits = t([[0.0, math.log(3.0)], [0.0, float("-inf")]])
    assert_close(entropy_from_logits(logits), t([0.56233514, 0.0]))


@pytest.mark.parametrize("temperature", [1e-3, 1e-2, 0.1, 1.0])
def test_entropy_at_a_low_temperature_matches_fp64(temperature):
    """fp32 logits near +10 divided by T = 1e-3: lse - sum(p z) cancelled two ~1e4 terms, up to 25 nats
    off (a negative train/entropy logged); -sum p log p stays within fp32 rounding of an fp64 reference."""
    g = torch.Generator().manual_seed(0)
    logits = 10 + torch.randn(64, 50, generator=g)
    z = logits.double() / temperature
    reference = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    got = entropy_from_logits(logits, temperature=temperature)
    assert (got >= 0).all()
    assert_close(got.double(), reference, atol=1e-4, rtol=1e-4)


def test_selective_log_softmax_hand_values():
    # softmax([0, ln 3]) = [1/4, 3/4]: log-probs ln(3/4) = -0.28768207, ln(1/4) = -1.38629436
    logits = t([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    assert_close(selective_log_softmax(logits, torch.tensor([[1, 0]])), t([[-0.28768207, -1.38629436]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_log_softmax_matches_reference(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11, generator=g)).to(dtype).requires_grad_()
    ids = torch.randint(0, 11, (3, 5), generator=g)
    upstream = torch.randn(3, 5, generator=g)

    got = selective_log_softmax(logits, ids, chunk_size=4)  # 15 rows: chunks of 4, 4, 4, 3
    assert got.dtype == torch.float32
    (got * upstream).sum().backward()
    got_grad, logits.grad = logits.grad, None

    ref = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).squeeze(-1)
    (ref * upstream).sum().backward()
    assert_close(got, ref)
    assert got_grad.dtype == dtype
    assert_close(got_grad, logits.grad)


def test_selective_log_softmax_gradcheck():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 5, dtype=F64, generator=g).requires_grad_()
    ids = torch.randint(0, 5, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda z: selective_log_softmax(z, ids, chunk_size=4), (logits,))
    assert torch.autograd.gradcheck(lambda z: selective_log_softmax(z, ids, chunk_size=4, temperature=0.7), (logits,))


def test_temperature_divides_bf16_logits_in_fp32():
    """log softmax(z / T) and its entropy of bf16 logits equal the fp32 computation on the same bf16
    values (what the samplers do: ``logits.float() / T``); dividing in bf16 first is off by up to
    ~0.1 nats at T = 0.7 on logits of size ~20, which the importance ratios would see."""
    g = torch.Generator().manual_seed(3)
    logits = (8 * torch.randn(4, 6, 300, generator=g)).to(torch.bfloat16)
    ids = torch.randint(0, 300, (4, 6), generator=g)
    ref = torch.log_softmax(logits.float() / 0.7, -1)  # (4, 6, 300)
    got = selective_log_softmax(logits, ids, chunk_size=5, temperature=0.7)
    assert_close(got, ref.gather(-1, ids[..., None]).squeeze(-1))
    entropy = entropy_from_logits(logits, chunk_size=5, temperature=0.7)  # lse - E[z]: fp32 order differs
    torch.testing.assert_close(entropy, -(ref.exp() * ref).sum(-1), atol=2e-4, rtol=1e-4)
    in_bf16 = selective_log_softmax(logits / 0.7, ids)
    assert (in_bf16 - got).abs().max() > 1e-2  # the error the fp32 division removes


def test_high_entropy_mask_keeps_the_top_share_of_valid_tokens():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 0.8]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # 7.0 is padding: never kept, never counted
    keep = high_entropy_mask(entropy, mask, 2 / 7)  # 7 valid tokens: threshold at the 5/7 quantile
    assert keep.tolist() == [[False, True, False, False], [False, False, False, True]]
    assert high_entropy_mask(entropy, mask, 1.0).tolist() == mask.bool().tolist()
    ties = torch.full((1, 5), 0.5)
    assert high_entropy_mask(ties, torch.ones(1, 5), 0.2).all()  # equal entropies: ties kept
    assert not high_entropy_mask(entropy, torch.zeros(2, 4), 0.2).any()
    # DDP: one threshold over every rank's tokens (this rank's entropies are all low: none kept)
    others = torch.full((20,), 9.0)
    assert not high_entropy_mask(entropy, mask, 2 / 7, all_entropies=torch.cat([entropy[mask.bool()], others])).any()


@pytest.mark.parametrize("n", [1, 2, 7, 1000])
def test_quantile_of_equals_torch_quantile_and_takes_any_length(n):
    from qerl.losses import quantile_of

    values = torch.randn(n, generator=torch.Generator().manual_seed(n))
    for q in (0.0, 0.2, 0.5, 0.8, 1.0):
        assert torch.equal(quantile_of(values, q), torch.quantile(values, q)), (n, q)
    big = torch.arange(2**24 + 3, dtype=torch.float32)  # torch.quantile raises above 2^24 elements
    assert quantile_of(big, 0.5).item() == (2**24 + 2) / 2


@pytest.mark.parametrize("aggregation", ["grpo", "dapo", "dr_grpo", "bnpo"])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_masked_positions_give_no_nan_gradient(aggregation, ratio_level):
    """Padding log-probs of -200 or -inf next to a reference of -10 (k3 KL on): the loss and every
    gradient stay finite, and the masked positions get exactly 0 (a where() in the sums alone would
    pass back 0 * inf = NaN)."""
    mask = torch.tensor([[True, True, False], [True, False, False]])
    for pad in (-200.0, float("-inf")):
        lp = torch.tensor([[-1.0, -2.0, pad], [-0.5, pad, pad]], requires_grad=True)
        old = torch.tensor([[-1.1, -1.9, 0.0], [-0.4, 0.0, 0.0]])
        ref = torch.full((2, 3), -10.0)
        loss, metrics = policy_loss(lp, old, torch.tensor([1.0, -1.0]), mask, aggregation=aggregation,
                                    ratio_level=ratio_level, ref_logprobs=ref, kl_coef=0.01,
                                    max_completion_length=3, num_tokens_total=3, num_sequences_total=2)
        loss.backward()
        assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values()), (pad, metrics)
        assert torch.isfinite(lp.grad).all() and (lp.grad[~mask] == 0).all() and (lp.grad[mask] != 0).all(), lp.grad
