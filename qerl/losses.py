"""GRPO / DAPO / Dr.GRPO losses as pure tensor functions (no Lightning, no model).

Shapes: N completions in a (micro-)batch, T padded completion length, V vocabulary, G samples per
prompt, B prompts (N = B*G for a full rollout batch). `mask` is (N, T), 1/True on real completion
tokens and 0/False on padding; bool, int or float masks are all accepted.

The objective follows TRL 0.21's `GRPOTrainer` (what the QeRL code runs), with DAPO's clip-higher,
token-level loss, dynamic-sampling filter and soft overlong penalty, Dr.GRPO's constant normaliser,
and TIS/MIS importance weights for the rollout/training mismatch that AQN and the vLLM FP4 kernel
introduce.

Micro-batch accumulation contract (the training step sums gradients over k micro-batches, then
steps once): `aggregate_loss` is written so that *summing* the micro-batch losses gives the loss of
the whole rollout batch, as long as the whole-batch counts are passed:

    mode      per micro-batch                                   pass               sum == full batch
    dapo      sum(valid loss) / num_tokens_total                num_tokens_total   exactly
    dr_grpo   sum(valid loss) / (num_sequences_total * L_max)   num_sequences_total exactly
    grpo      sum_i mean_t(loss_i) / num_sequences_total        num_sequences_total exactly
    bnpo      sum(valid loss) / local valid tokens              (nothing)          no: divide by k

Without the totals every mode falls back to a local mean, and the caller must divide by k (what
TRL's gradient accumulation does); that equals the full-batch loss only when micro-batches are
equally sized (sequences for grpo/dr_grpo, tokens for dapo). bnpo is the local token mean by
definition: k micro-batches give the mean of k token-means, which weights a token in a short
micro-batch more than one in a long micro-batch; dapo exists to remove that bias. Under DDP
gradients are averaged over W ranks, so pass totals divided by W (as TRL does).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["grpo", "bnpo", "dapo", "dr_grpo"]


# ------------------------------------------------------------------------------------------------
# Masked reductions


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x` where `mask` is set. Uses `where`, not `x * mask`, so inf/NaN in padding can't leak."""
    masked = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over positions where `mask` is set (over everything, or along `dim`).

    An empty mask gives 0, not NaN: the count is clamped to at least 1.
    """
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


# ------------------------------------------------------------------------------------------------
# Rewards -> advantages


def group_advantages(
    rewards: Tensor,
    group_size: int,
    scale: Literal["group", "batch", "none"] = "group",
    eps: float = 1e-4,
    batch_rewards: Tensor | None = None,
) -> Tensor:
    """GRPO advantages: reward minus its group's mean, optionally divided by a std.

    rewards: (B*G,) laid out group-contiguous (prompt 0's G samples first, then prompt 1's, ...).
    scale:
      "group" - divide by the group's std (GRPO, Eq. 4 of the QeRL paper; TRL `scale_rewards="group"`).
      "batch" - divide by the std of all B*G rewards (TRL `scale_rewards="batch"`): keeps the scale
                of easy/hard prompts comparable instead of inflating near-constant groups.
      "none"  - no division (Dr.GRPO: the std term biases towards low-variance prompts).
    The std is the *unbiased* one (torch's default, Bessel-corrected), following TRL, and the
    denominator is std + eps (TRL's 1e-4), so an all-equal group gets advantage exactly 0, never NaN.
    A std over a single element is undefined; it is taken as 0 (G=1 or one reward in total).
    batch_rewards: the rewards whose std "batch" divides by (default ``rewards``); under DDP the
    global batch's, gathered from every rank, as TRL does.
    Returns float (B*G,).
    """
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        shape = tuple(rewards.shape)
        raise ValueError(f"rewards must be 1-D with a multiple of {group_size=} elements, got {shape}")
    # float64: the fp32 mean of G equal rewards like 0.7 can be an ulp off, which the 1e-4 below
    # would turn into a same-sign advantage of ~6e-4 for the whole group instead of 0
    rewards = rewards.double()
    grouped = rewards.view(-1, group_size)  # (B, G)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)  # (B*G,)
    if scale == "none":
        return advantages.float()
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(grouped)  # (B, G)
        std = std.expand_as(grouped).reshape(-1)  # (B*G,)
    elif scale == "batch":
        pool = rewards if batch_rewards is None else batch_rewards.double().reshape(-1)
        std = pool.std() if pool.numel() > 1 else pool.new_zeros(())  # ()
    else:
        raise ValueError(f"unknown advantage scale {scale!r}; expected 'group', 'batch' or 'none'")
    return (advantages / (std + eps)).float()


def groups_with_signal(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """bool (B,): True for groups whose rewards are not all equal (max - min > eps).

    An all-equal group has zero advantage for every sample, so it contributes no policy gradient;
    DAPO's dynamic sampling drops these groups and refills the batch with ones that carry signal.
    """
    grouped = rewards.float().view(-1, group_size)  # (B, G)
    return (grouped.amax(dim=1) - grouped.amin(dim=1)) > eps


def overlong_penalty(
    completion_lengths: Tensor,
    max_completion_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> Tensor:
    """DAPO soft overlong punishment, added to the task reward. Returns float, same shape as lengths.

    0 while len <= max - buffer; then linear from 0 down to -penalty_factor across the buffer;
    -penalty_factor at (or beyond) max. A hard cutoff would punish a 4095-token correct answer
    as hard as a rambling one; the ramp tells the policy "shorter is better" before it hits the wall.
    """
    if not 0 < buffer_length <= max_completion_length:
        raise ValueError(f"need 0 < {buffer_length=} <= {max_completion_length=}")
    overshoot = completion_lengths.float() - (max_completion_length - buffer_length)  # (...)
    return -penalty_factor * (overshoot / buffer_length).clamp(0.0, 1.0)


# ------------------------------------------------------------------------------------------------
# Per-token terms


K3_KL_CAP = 10.0  # per-token cap of the k3 estimate (verl's low_var_kl)
K3_LOG_RATIO_CAP = 20.0  # |ref - lp| inside it (verl's too): exp(20) is finite in fp32 and bf16


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): exp(ref - lp) - (ref - lp) - 1.   (N, T)

    Unbiased for samples from pi, and >= 0 everywhere (e^x >= 1 + x), unlike the plain log-ratio.
    Gradients flow through `logprobs` only; `ref_logprobs` should come from a no-grad forward.
    Each token's value is capped at `K3_KL_CAP` (verl's low_var_kl does the same): exp(ref - lp)
    overflows fp32 beyond ~88 nats, and one such token would make the loss inf and skip the whole
    update; a capped token contributes no gradient, the others train as usual.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-K3_LOG_RATIO_CAP, K3_LOG_RATIO_CAP)  # (N, T); exp stays finite
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(max=K3_KL_CAP)


KLEstimator = Literal["k1", "k2", "k3"]


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs.   (N, T)

    k1 = lp - ref (unbiased value, but its gradient has mean zero on-policy: as a loss it does not
    pull towards the reference), k2 = (lp - ref)^2 / 2 (biased value; its gradient is the true reverse-KL
    gradient for on-policy samples), k3 = `k3_kl` (unbiased value, >= 0, low variance; GRPO's and the
    default; its gradient is that of KL(pi_ref || pi) on-policy). Schulman's "Approximating KL
    divergence" names them; verl offers the same three as kl_loss_type.
    """
    if estimator == "k3":
        return k3_kl(logprobs, ref_logprobs)
    log_ratio = logprobs - ref_logprobs  # (N, T)
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k1":
        return log_ratio
    raise ValueError(f"kl_penalty: estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def truncated_is_weights(
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    level: Literal["token", "sequence", "geometric"] = "token",
    mode: Literal["truncate", "mask"] = "truncate",
    cap: float = 2.0,
) -> Tensor:
    """Importance weights pi_train_old / pi_sampler correcting for rollouts drawn by a different engine.

    old_logprobs: (N, T) trainer's log-probs of the sampled tokens at rollout time (pi_theta_old).
    sampler_logprobs: (N, T) log-probs reported by the rollout engine (vLLM, FP4 kernel, AQN noise).
    level "token":    w_t = exp(old_t - sampler_t) per token.
    level "sequence": w = exp(sum over the sequence's valid tokens of (old - sampler)), the true
                      ratio of sequence probabilities, broadcast to every token of that sequence.
    level "geometric": w = exp(mean over those tokens of (old - sampler)), the per-token geometric
                      mean of that ratio: independent of the length, where a long completion's
                      product drifts far from 1 (verl's geometric level; caps near 1, e.g. 1.01).
    mode "truncate" (TIS): min(w, cap).  mode "mask" (MIS): w where w <= cap, else 0 (drop the token
    or sequence rather than trust a badly mismatched sample).
    Both modes are evaluated in log space, exp(min(log w, log cap)), so a long sequence's summed
    log-ratio cannot overflow to inf; this is exact, not an approximation. A NaN log-prob (an engine
    that returned none for a token) gives weight 0 there, for its whole sequence at the sequence
    levels, in either mode, rather than a NaN loss that would skip the whole batch's updates.
    Returns detached float32 (N, T) weights, 0 on padding.
    """
    valid = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=old_logprobs.device)
    log_ratio = torch.where(valid, old_logprobs.detach().float() - sampler_logprobs.float(), zero)  # (N, T)
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)  # (N, 1) -> (N, T)
    elif level == "geometric":
        tokens = valid.sum(dim=-1, keepdim=True).clamp(min=1)
        log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / tokens).expand_as(log_ratio)  # (N, 1) -> (N, T)
    elif level != "token":
        raise ValueError(f"unknown IS level {level!r}; expected 'token', 'sequence' or 'geometric'")
    log_cap = math.log(cap)
    weights = torch.exp(log_ratio.clamp(max=log_cap))  # (N, T), == min(w, cap)
    if mode == "mask":
        weights = torch.where(log_ratio > log_cap, zero, weights)
    elif mode != "truncate":
        raise ValueError(f"unknown IS mode {mode!r}; expected 'truncate' or 'mask'")
    return torch.where(valid & ~log_ratio.isnan(), weights, zero)


# ------------------------------------------------------------------------------------------------
# Aggregation and the clipped surrogate


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    mode: Aggregation,
    max_completion_length: int | None = None,
    num_sequences_total: int | None = None,
    num_tokens_total: int | Tensor | None = None,
) -> Tensor:
    """Reduce an (N, T) per-token loss to a scalar. See the module docstring for micro-batching.

    grpo:    mean over each sequence's valid tokens, then sum / num_sequences_total (default N:
             mean over sequences). Long answers get less weight per token (the GRPO length bias).
    bnpo:    sum over all valid tokens / valid tokens in *this* micro-batch (TRL "bnpo", the QeRL
             scripts' "DAPO").
    dapo:    sum over all valid tokens / num_tokens_total, the valid tokens of the whole rollout
             batch (falls back to the local count), so micro-batches sum to the full token mean.
    dr_grpo: sum over all valid tokens / (num_sequences_total (default N) * max_completion_length),
             a constant normaliser, so no length bias at all. max_completion_length is required.
    """
    valid = mask.bool()
    num_sequences = num_sequences_total if num_sequences_total is not None else per_token.size(0)
    if mode == "grpo":
        per_sequence = masked_mean(per_token, valid, dim=-1)  # (N,)
        return per_sequence.sum() / num_sequences
    total = masked_sum(per_token, valid)  # ()
    if mode == "bnpo":
        return total / valid.sum().clamp(min=1).to(total.dtype)
    if mode == "dapo":
        if isinstance(num_tokens_total, Tensor):  # the trainer's all-reduced count: stays on the device
            return total / num_tokens_total.clamp(min=1).to(total.dtype)
        if num_tokens_total is not None:
            return total / max(num_tokens_total, 1)
        return total / valid.sum().clamp(min=1).to(total.dtype)  # no .item(): avoids a GPU sync
    if mode == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("dr_grpo aggregation needs max_completion_length")
        return total / (num_sequences * max_completion_length)
    raise ValueError(f"unknown aggregation {mode!r}; expected 'grpo', 'bnpo', 'dapo' or 'dr_grpo'")


def quantile_of(values: Tensor, q: float) -> Tensor:
    """``torch.quantile(values, q)`` (linear interpolation) for a 1-D tensor of any length
    (``torch.quantile`` refuses more than 2^24 elements: 16.7 M tokens is one large rollout batch)."""
    n = values.numel()
    position = torch.tensor(q, dtype=values.dtype) * (n - 1)  # in the values' dtype, as torch.quantile
    lo = int(position.floor())
    hi = min(lo + 1, n - 1)
    v_lo = torch.kthvalue(values, lo + 1).values
    v_hi = torch.kthvalue(values, hi + 1).values if hi != lo else v_lo
    return torch.lerp(v_lo, v_hi, (position - lo).to(values.device))


def high_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float, all_entropies: Tensor | None = None) -> Tensor:
    """The valid tokens whose entropy is in the top ``quantile`` share: (N, T) bool.

    "Beyond the 80/20 rule" (Wang et al., 2025): RLVR's useful gradient comes from a minority of
    high-entropy "forking" tokens, and a policy gradient on the top 20% alone matched or beat all
    tokens on Qwen3 (TRL: ``top_entropy_quantile``). Kept: valid tokens with entropy >= the
    (1 - quantile) quantile of the valid tokens' entropies (ties kept); quantile 1 keeps them all.
    entropy: (N, T) token entropies; mask: (N, T) valid tokens; all_entropies: the valid tokens'
    entropies the threshold is taken over, when that is more than this batch (every DDP rank's)."""
    mask = mask.bool()
    if quantile >= 1.0 or not mask.any():
        return mask
    pool = entropy[mask] if all_entropies is None else all_entropies
    threshold = quantile_of(pool.float(), 1.0 - quantile)
    return mask & (entropy >= threshold)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: Aggregation = "grpo",
    ratio_level: Literal["token", "sequence"] = "token",
    is_weights: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    max_completion_length: int | None = None,
    num_tokens_total: int | Tensor | None = None,
    num_sequences_total: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/GRPO clipped surrogate with DAPO's decoupled clip range.

    logprobs: (N, T) current policy log-probs of the sampled tokens (with grad).
    old_logprobs: (N, T) pi_theta_old at rollout time; None means on-policy (one update per
        rollout), i.e. logprobs.detach(), so the ratio is 1 but its gradient is grad(logprobs).
    advantages: (N,) per sequence, or (N, T) per token.
    ratio_level: token (PPO/GRPO: r_t = pi(y_t) / pi_old(y_t)) or sequence (GSPO: one ratio per
        completion, s = exp(mean_t log r_t) over its valid tokens, shared by all its tokens and
        clipped as a whole; its gradient is s * mean_t grad log pi(y_t). GSPO clips tightly,
        e.g. clip_low 3e-4, clip_high 4e-4).
    dual_clip: optional c > 1 (dual-clip PPO, verl's clip_ratio_c, 3.0 there): for A < 0 the
        surrogate is also capped at -c * A, so a token whose ratio ran far above 1 (stale after K
        updates, or from a mismatched sampler) cannot make the loss -- and its gradient -- grow
        without bound; such a token gets no gradient. None: the plain clipped surrogate.
    is_weights: optional (N, T) detached per-token weights multiplied into the surrogate (not into
        the KL term, nor the normalizers), as TRL does: TIS/MIS weights (`truncated_is_weights`),
        times the 0/1 selection of `high_entropy_mask` when training on high-entropy tokens only.
    entropy: optional (N, T) token entropies of the current policy *with* grad
        (`entropy_from_logits` on the live logits); with entropy_coef > 0 an entropy bonus
        (verl's entropy_coeff) is subtracted per token, aggregated like the rest.

    per-token loss = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A) [* w] [+ kl_coef * KL]
                     [- entropy_coef * H],
    with r = exp(logprobs - old_logprobs), then `aggregate_loss(..., aggregation, ...)`.
    A clipped token has a constant surrogate, hence zero gradient: the update can't push the ratio
    further outside the trust region. clip_high > clip_low (DAPO: 0.28 vs 0.2) leaves more room
    to raise low-probability tokens, which counters entropy collapse.

    Metrics (detached float32 scalars over valid tokens of this micro-batch):
      clip_ratio/low  fraction with r < 1 - clip_low and A < 0 (the lower clip is active),
      clip_ratio/high fraction with r > 1 + clip_high and A > 0, clip_ratio/region either,
      clip_ratio/dual fraction with A < 0 held at -c * A by the dual clip (0 without it),
      kl              mean of the `kl_estimator` (k3 by default; logged whenever ref_logprobs is given,
                      even at kl_coef 0; else 0),
      ratio/mean      mean r.
    """
    if old_logprobs is None:
        old_logprobs = logprobs.detach()
    # Masked positions (padding, masked-out tokens) never reach exp() or the KL: where() in the sums
    # hides their values in the forward, but their gradient would be 0 * inf = NaN for a padding
    # log-prob of -200 or -inf. Here they take the old log-probs: ratio 1, no gradient.
    valid = mask.bool()
    logprobs = torch.where(valid, logprobs, old_logprobs.detach())
    if ref_logprobs is not None:
        ref_logprobs = torch.where(valid, ref_logprobs, old_logprobs.detach())
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # (N, 1), broadcasts over T
    advantages = advantages.to(logprobs.dtype)

    log_ratio = logprobs - old_logprobs  # (N, T)
    if ratio_level == "sequence":
        log_ratio = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)  # (N, T)
    elif ratio_level != "token":
        raise ValueError(f"policy_loss: ratio_level must be 'token' or 'sequence', got {ratio_level!r}")
    ratio = torch.exp(log_ratio)  # (N, T)
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (N, T)
    per_token = -torch.min(ratio * advantages, clipped_ratio * advantages)  # (N, T)
    dual = None
    if dual_clip is not None:
        # negative advantages only: the surrogate above grows like r * |A| there, the dual clip stops it at c * |A|
        dual = (advantages < 0) & (per_token > -dual_clip * advantages)  # (N, T)
        per_token = torch.where(dual, -dual_clip * advantages, per_token)
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(per_token.dtype)

    kl = None
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, kl_estimator)  # (N, T)
        if kl_coef > 0.0:
            per_token = per_token + kl_coef * kl
    if entropy_coef > 0.0:
        if entropy is None:
            raise ValueError("policy_loss: entropy_coef > 0 needs the per-token entropy")
        per_token = per_token - entropy_coef * entropy.to(per_token.dtype)

    loss = aggregate_loss(
        per_token,
        mask,
        aggregation,
        max_completion_length=max_completion_length,
        num_sequences_total=num_sequences_total,
        num_tokens_total=num_tokens_total,
    )

    with torch.no_grad():
        ratio_d = ratio.detach().float()
        low = (ratio_d < 1.0 - clip_low) & (advantages < 0)  # (N, T)
        high = (ratio_d > 1.0 + clip_high) & (advantages > 0)  # (N, T)
        metrics = {
            "clip_ratio/low": masked_mean(low.float(), mask),
            "clip_ratio/high": masked_mean(high.float(), mask),
            "clip_ratio/region": masked_mean((low | high).float(), mask),
            "clip_ratio/dual": masked_mean(dual.float(), mask) if dual is not None else ratio_d.new_zeros(()),
            "kl": masked_mean(kl.detach().float(), mask) if kl is not None else ratio_d.new_zeros(()),
            "ratio/mean": masked_mean(ratio_d, mask),
        }
    return loss, metrics
