"""AQNCallback: sets the adaptive-quantization-noise σ for each step and logs what it did.

At every rollout batch (before anything is generated) it asks the noise controller for σ given the
global step and the monitor state (recent mean rewards and entropies), draws one noise sample
seeded by (seed, global_step) into the noisy norms, and logs ``aqn/sigma``, ``aqn/stage``,
``aqn/fraction_changed`` (share of norm channels whose applied scale really changed: a silent
no-op shows as 0) and the controller's decisions (``aqn/plateau``, ``aqn/boost``). The same draw
is used by the rollout and, with ``apply_to: both``, by that step's training forwards; with
``apply_to: rollout`` (the paper's choice) training runs clean and truncated IS corrects the
mismatch. Noise is always off for the reference (KL) pass and for validation/test.
"""

from __future__ import annotations

import logging
import math
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from qerl.seeding import resolve_seed, warn_if_seed_changed
from qerl.aqn import ExponentialSchedule, MonitorState, NoiseController, attach_noisy_norms, controller_settings

log = logging.getLogger(__name__)


def unvisited_stages_message(controller: NoiseController, max_steps: int, updates_per_rollout: int) -> str | None:
    """A warning when a staged schedule (or an adaptive controller's base) that follows
    ``trainer.max_steps`` leaves stages unused: σ is set once per rollout batch, i.e. at every
    ``updates_per_rollout``-th optimizer step, and a stage shorter than that (or than one step) can fall
    between two batches -- the last one too, so sigma_end is never applied."""
    staged = controller if getattr(controller, "num_stages", None) else getattr(controller, "base", None)
    stages = getattr(staged, "num_stages", None)  # (the schedule itself, or the adaptive controller's base)
    if not stages or max_steps is None or max_steps < 1 or getattr(staged, "max_steps", None) is not None:
        return None  # (a schedule with its own max_steps may span several runs)
    seen = {staged.stage(step, MonitorState(max_steps=max_steps)) for step in range(0, max_steps, updates_per_rollout)}
    missing = sorted(set(range(stages)) - seen)
    if not missing:
        return None
    return (f"AQN: the schedule's stages {missing} are never applied: with trainer.max_steps={max_steps} its "
            f"{stages} stages last {max_steps / stages:g} optimizer steps each, and sigma is set once per rollout "
            f"batch (every {updates_per_rollout} steps: updates_per_rollout)"
            f"{'; sigma_end is not reached' if stages - 1 in missing else ''}: raise trainer.max_steps, lower "
            "num_stages, or set the controller's max_steps")


class AQNCallback(L.Callback):
    """Adaptive Quantization Noise on the RMSNorm scales.

    Args:
        controller: the noise controller (``qerl.aqn`` class by ``class_path``; default: the paper's
            exponential schedule, 10 stages, 1e-2 → 5e-4).
        apply_to: rollout (generation only, as in the paper; needs TIS) or both (rollout and training).
        module_names: norms that receive noise, matched by the end of their module name.
        seed: noise seed; the draw for a step depends only on (seed, global_step); null: the run's
            ``seed_everything``.
        history: how many recent steps of reward/entropy the controller sees.
        scale_precision: fp32 (the noisy scale w + Z as drawn; right for the hf engine) or bf16 (w + Z
            stochastically rounded to bf16, unbiased): use bf16 with ``engine: vllm``, which keeps
            norms in bf16 and would otherwise round noise below half a bf16 step (~4e-3 near 1) away.
    """

    def __init__(
        self,
        controller: NoiseController | None = None,
        apply_to: Literal["rollout", "both"] = "both",
        module_names: list[str] | None = None,
        seed: int | None = None,
        history: int = 200,
        scale_precision: Literal["fp32", "bf16"] = "fp32",
    ):
        self.controller = controller if controller is not None else ExponentialSchedule()
        self.apply_to = apply_to
        self.module_names = module_names or ["input_layernorm", "post_attention_layernorm"]
        self.seed = resolve_seed(seed, "AQNCallback.seed")
        self.history = history
        window = int(getattr(self.controller, "window", 0) or 0)  # a closed-loop controller's moving average
        if history < max(1, window):
            raise ValueError(f"AQNCallback: history={history} must be >= 1 and hold the controller's window={window} "
                             "(else its moving average never forms and it never reacts)")
        self.scale_precision = scale_precision
        self.monitor = MonitorState()
        self._prepared_step = -1
        self._eval_context = None

    def on_fit_start(self, trainer, pl_module) -> None:
        if pl_module.noisy_norms is None:
            try:
                pl_module.noisy_norms = attach_noisy_norms(pl_module.model, self.module_names)
            except ValueError as err:  # (no such module, or not a norm: say which setting chose them)
                raise ValueError(f"AQNCallback.module_names={list(self.module_names)}: {err}") from err
        pl_module.aqn_apply_to = self.apply_to
        self.monitor.max_steps = max(1, trainer.max_steps)
        updates = getattr(getattr(pl_module, "loss_settings", None), "updates_per_rollout", 1)
        if message := unvisited_stages_message(self.controller, trainer.max_steps, updates):
            if trainer.is_global_zero:  # once, not once per DDP rank
                log.warning(message)
        if self.apply_to == "rollout" and getattr(getattr(pl_module, "loss_settings", None), "tis_cap", 0) is None:
            rank_zero_warn("AQNCallback(apply_to: rollout) with model.loss.tis_cap: null: the rollout samples "
                           "with noise, training runs without, and no importance weights correct the mismatch "
                           "(set a tis_cap, e.g. 2.0, or apply_to: both)")

    def prepare_step(self, trainer, pl_module) -> None:
        """Set σ for the current global step (idempotent; the RolloutCallback calls it first)."""
        step = trainer.global_step
        if step == self._prepared_step or pl_module.noisy_norms is None:
            return
        self._prepared_step = step
        sigma = float(self.controller.sigma(step, self.monitor))
        pl_module.noisy_norms.set_noise(sigma, self.seed, step, self.scale_precision)
        metrics = {
            "aqn/sigma": sigma,
            "aqn/stage": float(self.controller.stage(step)),
            "aqn/fraction_changed": pl_module.noisy_norms.fraction_changed(),
        }
        # moving averages: absent until their window fills (no earlier point for Lightning to repeat);
        # any other NaN (the adaptive controller's undefined boost) is logged as NaN: left out, the
        # curve would repeat the previous step's value
        metrics.update({f"aqn/{k}": float(v) for k, v in self.controller.last_decision.items()
                        if not (math.isnan(float(v)) and k.endswith("_ma"))})
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.prepare_step(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """Feed the state monitor with this step's mean reward and entropy, both over all DDP ranks
        (``train/entropy`` is logged reduced): every rank's controller then takes the same decision,
        so all ranks draw the same noise, and rank 0's checkpointed state is every rank's."""
        rollout = batch.get("rollout") if isinstance(batch, dict) else None
        if rollout is not None:  # every sampled group's reward: dynamic sampling's kept ones stay near 0.5
            reward = torch.tensor(rollout.mean_sampled_reward())
            if getattr(trainer, "world_size", 1) > 1:
                reward = trainer.strategy.reduce(reward.to(pl_module.device), reduce_op="mean")
            if math.isfinite(float(reward)):
                self.monitor.rewards.append(float(reward))
        entropy = trainer.callback_metrics.get("train/entropy")
        if entropy is not None and math.isfinite(float(entropy)):  # NaN: no token sampled, nothing seen
            self.monitor.entropies.append(float(entropy))
        self.monitor.rewards = self.monitor.rewards[-self.history:]
        self.monitor.entropies = self.monitor.entropies[-self.history:]

    # evaluation never sees noise
    def _noise_off(self, pl_module) -> None:
        if pl_module.noisy_norms is not None and self._eval_context is None:
            self._eval_context = pl_module.noisy_norms.disable()
            self._eval_context.__enter__()

    def _noise_restore(self) -> None:
        if self._eval_context is not None:
            self._eval_context.__exit__(None, None, None)
            self._eval_context = None

    def on_validation_start(self, trainer, pl_module) -> None:
        self._noise_off(pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._noise_restore()

    def on_test_start(self, trainer, pl_module) -> None:
        self._noise_off(pl_module)

    def on_test_end(self, trainer, pl_module) -> None:
        self._noise_restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._noise_restore()  # a validation that raised: the next fit in this process trains with noise again

    def settings(self) -> dict:
        """What shapes the noise (saved with checkpoints, compared on resume)."""
        return {"controller": controller_settings(self.controller), "apply_to": self.apply_to,
                "module_names": list(self.module_names), "scale_precision": self.scale_precision}

    def state_dict(self) -> dict:
        return {
            "settings": self.settings(),
            "controller": self.controller.state_dict(),
            "rewards": list(self.monitor.rewards),
            "entropies": list(self.monitor.entropies),
            "seed": self.seed,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        warn_if_seed_changed("AQNCallback (the noise draws)", state_dict.get("seed"), self.seed)
        saved, now = state_dict.get("settings"), self.settings()
        if saved is not None and saved != now:  # the config runs (as for the rollout settings); the curves change
            changed = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
            rank_zero_warn(f"AQNCallback: resumed with other noise settings than the checkpoint's "
                           f"(checkpoint -> now): {changed}")
        self.controller.load_state_dict(state_dict.get("controller", {}))
        self.monitor.rewards = list(state_dict.get("rewards", []))
        self.monitor.entropies = list(state_dict.get("entropies", []))
