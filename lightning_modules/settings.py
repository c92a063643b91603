"""The settings of QeRLModule (``model.loss``, ``model.optimizer``) and the checks and schedules built
on them: pure data and functions, no Lightning state."""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import Literal

from qerl.settings_checks import require_numbers


@dataclass
class LossSettings:
    """The RL objective.

    Args:
        advantage_scale: divide (r - group mean) by the group std, the batch std (under DDP: of every
            rank's rewards), or nothing (Dr.GRPO).
        aggregation: grpo (mean per sequence, then over sequences), bnpo (token mean per micro-batch),
            dapo (token mean over the whole rollout batch, every rank's under DDP), dr_grpo
            (sum / (N * max_new_tokens)).
        clip_low: ratio lower clip epsilon (1 - clip_low).
        clip_high: ratio upper clip epsilon (1 + clip_high); 0.28 is DAPO's clip-higher.
        dual_clip: dual-clip PPO's c (> 1; verl's clip_ratio_c, 3.0 there): for negative advantages
            the surrogate is capped at c x |A|, so tokens whose ratio ran far above 1 add no gradient;
            null (default, as TRL and the QeRL code) leaves the plain clipped surrogate.
        ratio_level: token (PPO/GRPO) or sequence (GSPO: one length-normalised ratio per completion,
            clipped as a whole; use GSPO's tight clips, e.g. clip_low 3e-4 and clip_high 4e-4).
        kl_coef: weight of the KL to the reference (adapter disabled, no noise); 0 skips that pass.
        kl_estimator: the per-token KL estimate (Schulman's; verl's kl_loss_type): k3 (default, GRPO's:
            unbiased, >= 0, capped at 10 per token), k2 ((lp - ref)^2 / 2: its gradient is the reverse-KL
            gradient on-policy) or k1 (lp - ref: its gradient averages to zero on-policy).
        entropy_coef: weight of an entropy bonus (verl's entropy_coeff; the classic alternative to
            AQN for keeping exploration up): minus entropy_coef x token entropy, aggregated like the
            loss. 0 (default) keeps the entropy a logged, detached metric; > 0 backpropagates through
            it, which keeps an fp32 (tokens x vocab) softmax per micro-batch alive for backward.
        updates_per_rollout: optimizer steps per rollout batch (QeRL GSM8K: 4; BigMath: 1).
        micro_batch_size: completions per forward/backward (gradient accumulation inside an update).
        group_by_length: fill micro-batches with completions of similar length (sorted, stable), so
            that each forward, cut to its own micro-batch's longest prompt and completion, computes
            little padding; grpo / dapo / dr_grpo updates are the same either way (up to rounding).
            bnpo keeps rollout order (its token mean per micro-batch would weigh the tokens of short
            completions up in sorted micro-batches). false: in rollout order (each micro-batch is
            still cut to its own longest rows).
        tis_level: importance weights per token, per sequence (the product of its token ratios), or
            geometric (their per-token geometric mean, length-independent; use a cap near 1, e.g. 1.01)
            (trainer vs sampler log-probs).
        tis_mode: truncate (TIS: min(w, cap)) or mask (MIS: drop tokens with w > cap).
        tis_cap: the cap (>= 1: an on-policy token's weight is 1); null disables importance-sampling correction.
        mask_truncated: exclude completions that hit max_new_tokens from the loss (DAPO overlong filtering).
        top_entropy_quantile: apply the clipped surrogate only to the tokens whose entropy is in this top
            share of the rollout batch (e.g. 0.2: "Beyond the 80/20 rule"; TRL's top_entropy_quantile);
            the entropies are the pre-update policy's (one no-grad pass), so the chosen tokens stay the
            same over the K updates and for any micro_batch_size; normalizers and the KL term are
            unchanged, as in TRL. With ``ratio_level: sequence`` the sequence ratio still averages every
            token (TRL's too), so the kept tokens only weight their sequence's term and its gradient
            reaches all of its tokens. 1.0 (default) trains on every token.
    """

    advantage_scale: Literal["group", "batch", "none"] = "group"
    aggregation: Literal["grpo", "bnpo", "dapo", "dr_grpo"] = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    ratio_level: Literal["token", "sequence"] = "token"
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0
    updates_per_rollout: int = 1
    micro_batch_size: int = 8
    group_by_length: bool = True
    tis_level: Literal["token", "sequence", "geometric"] = "token"
    tis_mode: Literal["truncate", "mask"] = "truncate"
    tis_cap: float | None = 2.0
    mask_truncated: bool = False
    top_entropy_quantile: float = 1.0

    def __post_init__(self) -> None:  # a bad YAML value fails at start, naming its key
        require_numbers(self, "model.loss")
        for key, allowed in _CHOICES.items():  # (the CLI checks these too; settings built in code do not)
            if getattr(self, key) not in allowed:
                raise ValueError(f"model.loss.{key} must be one of {', '.join(allowed)}, got {getattr(self, key)!r}")
        for key in ("updates_per_rollout", "micro_batch_size"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"model.loss.{key} must be >= 1, got {getattr(self, key)}")
        # every comparison is written so that NaN fails it (`x < 0` is false for NaN: a NaN kl_coef
        # would drop the KL term silently) and infinities are refused by name
        # (.inf: weights without truncation). Below 1 an on-policy token (weight 1) is past the cap:
        # mask mode would drop every token (nothing trains), truncate mode scale the whole loss down
        if self.tis_cap is not None and not self.tis_cap >= 1:
            raise ValueError(f"model.loss.tis_cap must be >= 1 (or null: no IS correction), got {self.tis_cap}")
        if not 0 < self.top_entropy_quantile <= 1:
            raise ValueError(f"model.loss.top_entropy_quantile must be in (0, 1], got {self.top_entropy_quantile}")
        for key in ("clip_low", "clip_high"):  # (.inf: that side unclipped)
            if not getattr(self, key) >= 0:
                raise ValueError(f"model.loss.{key} must be >= 0, got {getattr(self, key)}")
        if self.dual_clip is not None and not (self.dual_clip > 1 and math.isfinite(self.dual_clip)):
            raise ValueError(f"model.loss.dual_clip must be > 1 and finite (or null: off), got {self.dual_clip}")
        for key in ("kl_coef", "entropy_coef"):
            value = getattr(self, key)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"model.loss.{key} must be >= 0 and finite, got {value}")


_CHOICES = {key: typing.get_args(typing.get_type_hints(LossSettings)[key])
            for key in ("advantage_scale", "aggregation", "ratio_level", "kl_estimator", "tis_level", "tis_mode")}


@dataclass
class OptimizerSettings:
    """AdamW and its learning-rate schedule (QeRL: lr 1e-5, betas (0.9, 0.99), wd 0.1, 10% warmup, cosine).

    Args:
        lr: peak learning rate.
        weight_decay: decoupled weight decay.
        betas: AdamW betas.
        warmup_ratio: fraction of ``trainer.max_steps`` spent warming up linearly: warmup step s of w
            runs at (s + 1) / (w + 1) of ``lr`` (never at 0, which would waste the first rollout batch).
        schedule: shape after warmup: cosine to 0, linear to 0, or constant.
        max_grad_norm: gradient clipping threshold (total L2 norm).
    """

    lr: float = 1e-5
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.99)
    warmup_ratio: float = 0.1
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    max_grad_norm: float = 0.2

    def __post_init__(self) -> None:  # a bad YAML value fails at start, not after the model loads
        require_numbers(self, "model.optimizer")
        # NaN fails every comparison below; an infinite (or overflowing, 1e40) lr is an AdamW overflow
        # at the first step and a NaN weight decay writes NaN weights into checkpoints
        if not (self.lr > 0 and self.lr < _MAX_LR):
            raise ValueError(f"model.optimizer.lr must be > 0 and < {_MAX_LR:g}, got {self.lr}")
        if not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
            # a negative threshold flips the gradient (training goes uphill); a huge finite one is "no clipping"
            raise ValueError(f"model.optimizer.max_grad_norm must be > 0 and finite, got {self.max_grad_norm}")
        if not 0 <= self.warmup_ratio <= 1:
            raise ValueError(f"model.optimizer.warmup_ratio must be in [0, 1], got {self.warmup_ratio}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"model.optimizer.weight_decay must be >= 0 and finite, got {self.weight_decay}")
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):  # (AdamW's own range; NaN fails it)
            raise ValueError(f"model.optimizer.betas must be two values in [0, 1), got {list(betas)}")


# An lr at or above this is a typo, not a learning rate: AdamW's update lr * m / sqrt(v) overflows
# float32 (max 3.4e38) well before, and no LoRA recipe uses an lr above 1.
_MAX_LR = 1e3


# Lightning warnings whose advice does not apply to this module (silenced when QeRLModule is built):
LIGHTNING_ADVICE_THAT_DOES_NOT_APPLY = (
    # step checkpoints should hold a "pre-optimization" copy of the weights: here the post-step state is
    # the right one, it pairs with the optimizer state and global_step that resume continues from
    "Using ModelCheckpoint with manual optimization",
    # prompts are tokenized once, when the first dataloader is built: a batch is a list of ready rows,
    # and a worker process would only add start-up time
    "The '(train|val|test)_dataloader' does not have many workers",
    # intended: on_after_batch_transfer restores a resumed run's RNG (see there)
    "You have overridden `on_after_batch_transfer`",
    # the x-axis and the eval metrics are the same on every rank (the eval records are gathered first);
    # vLLM initialises torch.distributed even on one GPU, which is what triggers the advice there
    r"It is recommended to use `self.log\('(step|val/|test/)",
    # validate / test on several ranks: the sampler's padded repeats are dropped when the records are
    # gathered, so each problem counts once (lightning_modules/evaluation.py, merge_records)
    r"Using `DistributedSampler` with the dataloaders. During `trainer.(validate|test)\(\)`",
)


def step_count_warnings(callbacks: list, updates_per_rollout: int, max_steps: int) -> list[str]:
    """Counts that do not fit ``updates_per_rollout`` (K): global_step grows by K per rollout batch.

    One message per ``ModelCheckpoint(every_n_train_steps=n)`` whose n is not a multiple of K
    (Lightning saves when ``global_step % n == 0``, so such a callback saves only every lcm(n, K)
    steps), and one when ``max_steps`` is not a multiple of K (the last batch runs past it; its
    extra updates see the schedule's final LR: 0 for cosine and linear)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    out = []
    for cb in callbacks:
        n = getattr(cb, "_every_n_train_steps", 0) if isinstance(cb, ModelCheckpoint) else 0
        if n > 0 and n % updates_per_rollout:
            out.append(f"ModelCheckpoint(every_n_train_steps={n}) will save every {math.lcm(n, updates_per_rollout)} "
                       f"optimizer steps: global_step grows by updates_per_rollout={updates_per_rollout} per rollout "
                       f"batch; use a multiple of {updates_per_rollout}")
    if max_steps > 0 and max_steps % updates_per_rollout:
        end = math.ceil(max_steps / updates_per_rollout) * updates_per_rollout
        out.append(f"trainer.max_steps={max_steps} is not a multiple of updates_per_rollout={updates_per_rollout}: "
                   f"the last rollout batch runs on to step {end}, {end - max_steps} update(s) past the LR schedule's "
                   f"end (at lr 0 for cosine and linear); use a multiple of {updates_per_rollout}")
    return out


def decay_flags(params: list) -> list[bool]:
    """Which trainable tensors get weight decay: matrices (LoRA A / B) do, vectors (trainable RMSNorm
    scales) do not -- decay would pull a norm's scale toward 0 (HF Trainer and TRL exempt norms and
    biases alike)."""
    return [p.dim() >= 2 for p in params]


def _decayed_then_not(items: list, flags: list[bool]) -> tuple[list, list]:
    """``items`` split by ``flags`` (from :func:`decay_flags`), each part in its order: the layout of
    the AdamW groups, which the optimizer's state ids follow."""
    return [x for x, d in zip(items, flags) if d], [x for x, d in zip(items, flags) if not d]


def param_groups(params: list, weight_decay: float) -> list[dict]:
    """AdamW groups of the trainable tensors, in order: decayed matrices, then (when there are any)
    the undecayed vectors; ``decay`` marks which is which (kept in checkpoints)."""
    matrices, vectors = _decayed_then_not(params, decay_flags(params))
    groups = [{"params": matrices, "weight_decay": weight_decay, "decay": True}]
    if vectors:
        groups.append({"params": vectors, "weight_decay": 0.0, "decay": False})
    return groups


def split_one_group_state(state: dict, flags: list[bool]) -> dict:
    """An optimizer state dict of one param group over the trainable tensors (checkpoints written
    before vectors got their own undecayed group) in the layout of :func:`param_groups`."""
    if len(state["param_groups"]) != 1 or all(flags):
        return state
    (group,) = state["param_groups"]
    old = group["params"]  # the ids of the trainable tensors, in order
    decayed, vectors = _decayed_then_not(list(range(len(flags))), flags)
    new_id = {old[i]: new for new, i in enumerate(decayed + vectors)}
    n = len(decayed)
    return {
        "state": {new_id[k]: v for k, v in state["state"].items()},
        "param_groups": [{**group, "params": list(range(n)), "decay": True},
                         {**group, "params": list(range(n, len(flags))), "weight_decay": 0.0, "decay": False}],
    }


def lr_factor(step: int, total: int, warmup_ratio: float, schedule: str) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` of ``total``."""
    warmup = math.floor(warmup_ratio * total + 1e-9)  # 0.29 * 100 = 28.999999999999996: 29 warmup steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    # warmup_ratio 1.0 leaves no decay steps: a step past the end (a resume with a larger max_steps
    # reads the new total, but a manual call may not) sits at the schedule's end, not back at the peak
    progress = 1.0 if total <= warmup else min(1.0, (step - warmup) / (total - warmup))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    return 1.0


def apply_optimizer_settings(optimizer, scheduler, settings: OptimizerSettings, max_steps: int,
                             saved_max_steps: int | None = None) -> list[str]:
    """Make a resumed optimizer and LR schedule follow the config, not the checkpoint; returns what changed.

    Restoring a checkpoint brings back each param group's lr, betas and weight decay and the
    scheduler's ``base_lrs``: a resume with a new ``lr`` would keep the old peak, and a new
    ``max_steps`` would take its first update at the lr the old schedule had reached. Here every
    group gets the configured hyperparameters and the lr of the (current) schedule at the restored
    step. A fresh run is left exactly as built."""
    changed = []
    if saved_max_steps is not None and saved_max_steps != max_steps:
        changed.append(f"trainer.max_steps changed from {saved_max_steps} to {max_steps} on resume: the LR schedule "
                       f"and the AQN stages are laid out over {max_steps} steps from step {scheduler.last_epoch} on")
    for group in optimizer.param_groups:
        decay = settings.weight_decay if group.get("decay", True) else 0.0  # norm scales: never decayed
        wanted = {"lr": settings.lr, "betas": tuple(settings.betas), "weight_decay": decay}
        saved = {"lr": group.get("initial_lr", group["lr"]), "betas": tuple(group["betas"]),
                 "weight_decay": group["weight_decay"]}
        for key, value in wanted.items():
            if saved[key] != value and group.get("decay", True):
                changed.append(f"model.optimizer.{key} changed from {saved[key]} to {value} on resume: using {value}")
        group.update(initial_lr=settings.lr, betas=wanted["betas"], weight_decay=decay)
    scheduler.base_lrs = [settings.lr for _ in optimizer.param_groups]
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
    return list(dict.fromkeys(changed))  # one line per change, not one per param group


def hparam_differences(config: dict, saved: dict, prefix: str = "model") -> list[str]:
    """``"model.loss.kl_coef: 0.01 (config) vs 0.0 (checkpoint)"`` for every value of the config
    that a checkpoint's hyperparameters hold differently (nested settings compared key by key;
    tuples and lists alike; keys the checkpoint lacks, e.g. from an older version, are skipped)."""
    out = []
    for key, value in config.items():
        if key not in saved or key.startswith("_"):
            continue
        old, name = saved[key], f"{prefix}.{key}"
        if isinstance(value, dict) and isinstance(old, dict):
            out += hparam_differences(value, old, name)
        elif (list(value) if isinstance(value, tuple) else value) != (list(old) if isinstance(old, tuple) else old):
            out.append(f"{name}: {value!r} (config) vs {old!r} (checkpoint)")
    return out

