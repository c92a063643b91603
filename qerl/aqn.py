"""Adaptive Quantization Noise (AQN): noise controllers and noisy RMSNorm scales.

AQN (QeRL, Eqs. 8-10) adds channel-wise noise Z ~ N(0, sigma^2) of size ``hidden`` to the RMSNorm
scale before q/k/v (``input_layernorm``) and gate/up (``post_attention_layernorm``):
(w + Z) * x / sqrt(mean(x^2) + eps), i.e. row-wise multiplicative noise (1 + Z/w) on the frozen weights.

* Noise controllers (chosen in YAML by ``class_path``) give sigma per optimizer step: staged
  schedules (exponential is the paper's), periodic re-heats, or a closed loop on reward/entropy.
* :func:`attach_noisy_norms` (``qerl/noisy_norms.py``, re-exported here) wraps the norms, matched by
  module *name* (the released code's isinstance test never matches vLLM's norms), and applies the
  noise in fp32 inside the forward; the weight is never modified.

``step`` is the number of optimizer steps already taken (Lightning's ``global_step``), so 0-based.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from qerl.noisy_norms import NoisyNorms, attach_noisy_norms, noise_seed, stochastic_round_bf16  # noqa: F401  (re-exported: AQN in one place)


# ----------------------------------------------------------------------------- controllers
@dataclass
class MonitorState:
    """What a controller may look at when choosing sigma for a step.

    Args:
        rewards: Mean reward of each past step, oldest first (recent history; may be truncated).
        entropies: Mean token entropy of each past step, oldest first.
        max_steps: Total number of optimizer steps of the run.
    """

    rewards: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    max_steps: int = 0


class NoiseController:
    """Base class: maps an optimizer step (and the training monitor) to a noise sigma."""

    def __init__(self) -> None:
        self.last_decision: dict[str, float] = {}

    def sigma(self, step: int, state: MonitorState | None = None) -> float:
        """The noise standard deviation for optimizer step ``step`` (0-based)."""
        raise NotImplementedError

    def stage(self, step: int) -> int:
        """Stage index for logging ``aqn/stage``; -1 where stages mean nothing."""
        return -1

    def state_dict(self) -> dict:
        """Checkpointable own state (empty for stateless controllers)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""


class NoNoise(NoiseController):
    """AQN off: sigma = 0 at every step (only the inherent quantization noise acts)."""

    def sigma(self, step: int, state: MonitorState | None = None) -> float:
        return 0.0


class ConstantNoise(NoiseController):
    """The same sigma at every step.

    Args:
        sigma: Noise standard deviation.
    """

    def __init__(self, sigma: float = 1e-2) -> None:
        super().__init__()
        _check("ConstantNoise", finite=dict(sigma=sigma), sigma__ge_0=sigma >= 0)
        self.value = float(sigma)

    def sigma(self, step: int, state: MonitorState | None = None) -> float:
        return self.value

    def stage(self, step: int) -> int:
        return 0


def _check(owner: str, finite: dict[str, float | None] | None = None, **conditions: bool) -> None:
    """One line naming the first setting whose condition fails (at construction, not at the first step):
    ``sigma__ge_0=sigma >= 0`` reads "needs sigma >= 0". ``finite``: settings (None: unset) that must
    be finite numbers, checked first -- ``inf >= 0`` holds, and an infinite sigma was refused only at
    step 1 (by the noisy norms), after the model had loaded."""
    for name, value in (finite or {}).items():
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{owner} needs a finite {name}, got {value}")
    for what, ok in conditions.items():
        if not ok:
            name, _, rest = what.partition("__")
            op, _, bound = rest.partition("_")
            raise ValueError(f"{owner} needs {name} {dict(ge='>=', gt='>')[op]} {bound}")


def _max_steps(own: int | None, state: MonitorState | None) -> int:
    n = own if own is not None else (state.max_steps if state is not None else 0)
    if n <= 0:
        raise ValueError("max_steps is unknown: set it on the controller or pass MonitorState(max_steps=...)")
    return int(n)


class StagedSchedule(NoiseController):
    """Training split into ``num_stages`` equal stages (paper, Algorithm 1); stage 0 has sigma = 0.

    Stage k of step s (0-based) is ``min(floor(s * K / max_steps), K - 1)``: stages as equal as whole
    steps allow (their lengths differ by at most one). Where K divides max_steps this is the paper's
    ``floor((step - 1) / steps_per_stage)`` with its 1-based steps; otherwise the official code's
    ``steps_per_stage = max_steps // K`` piles the remainder onto the last stage (max_steps = 19,
    K = 10: stages of 1 step and a last one of 10, sigma_end from 47% of the run). Stages 1..K-1 decay from
    ``sigma_start`` to ``sigma_end`` along a shape f(t), t in [0, 1], which subclasses define.

    Args:
        sigma_start: sigma of stage 1 (the first noisy stage).
        sigma_end: sigma of the last stage K-1 (when ``reach_end``).
        num_stages: K, the number of stages including the noise-free stage 0.
        max_steps: Total optimizer steps; None takes ``MonitorState.max_steps``.
        reach_end: True: t = (k-1)/(K-2), so stage K-1 is exactly sigma_end (official code).
            False: t = (k-1)/(K-1), the paper's Eq. 8 read literally, which stops one step short.
    """

    def __init__(self, sigma_start: float = 1e-2, sigma_end: float = 5e-4, num_stages: int = 10,
                 max_steps: int | None = None, reach_end: bool = True) -> None:
        super().__init__()
        if num_stages < 2:
            raise ValueError("num_stages must be >= 2 (stage 0 is noise-free)")
        if num_stages == 2 and reach_end:  # t = (k-1)/(K-2) has no value: one stage cannot be both
            raise ValueError(f"{type(self).__name__}: num_stages=2 leaves one noisy stage, which cannot be both "
                             "sigma_start and sigma_end; use num_stages >= 3, reach_end: false (that stage is "
                             "sigma_start) or ConstantNoise")
        _check(type(self).__name__, finite=dict(sigma_start=sigma_start, sigma_end=sigma_end),
               sigma_start__ge_0=sigma_start >= 0, sigma_end__ge_0=sigma_end >= 0,
               max_steps__ge_1=max_steps is None or max_steps >= 1)  # (0 would read as "unknown" at step 1)
        self.sigma_start, self.sigma_end = float(sigma_start), float(sigma_end)
        self.num_stages, self.max_steps, self.reach_end = int(num_stages), max_steps, reach_end
        self._state_max_steps: int | None = None

    def _shape(self, t: float) -> float:
        raise NotImplementedError

    def stage(self, step: int, state: MonitorState | None = None) -> int:
        if self.max_steps is None and state is None and self._state_max_steps is not None:
            state = MonitorState(max_steps=self._state_max_steps)
        return min(max(step, 0) * self.num_stages // _max_steps(self.max_steps, state), self.num_stages - 1)

    def sigma(self, step: int, state: MonitorState | None = None) -> float:
        if state is not None:
            self._state_max_steps = state.max_steps
        k = self.stage(step, state)
        if k == 0:
            return 0.0
        denom = self.num_stages - 2 if self.reach_end else self.num_stages - 1
        return float(self._shape((k - 1) / denom if denom > 0 else 0.0))


class ExponentialSchedule(StagedSchedule):
    """The paper's default (Eq. 8): sigma_k = sigma_start * (sigma_end / sigma_start) ** t."""

    def __init__(self, sigma_start: float = 1e-2, sigma_end: float = 5e-4, num_stages: int = 10,
                 max_steps: int | None = None, reach_end: bool = True) -> None:
        if not (sigma_start > 0 and sigma_end > 0):  # geometric: use LinearSchedule to decay to 0
            raise ValueError(f"ExponentialSchedule needs sigma_start, sigma_end > 0, got {sigma_start}, {sigma_end}")
        super().__init__(sigma_start, sigma_end, num_stages, max_steps, reach_end)

    def _shape(self, t: float) -> float:
        return self.sigma_start * (self.sigma_end / self.sigma_start) ** t


class LinearSchedule(StagedSchedule):
    """Linear decay over the noisy stages: sigma_start + (sigma_end - sigma_start) * t."""

    def _shape(self, t: float) -> float:
        return self.sigma_start + (self.sigma_end - self.sigma_start) * t


class CosineSchedule(StagedSchedule):
    """Half-cosine decay over the noisy stages: sigma_end + (sigma_start - sigma_end) * (1 + cos(pi t)) / 2."""

    def _shape(self, t: float) -> float:
        return self.sigma_end + (self.sigma_start - self.sigma_end) * 0.5 * (1.0 + math.cos(math.pi * t))


class LogarithmicSchedule(StagedSchedule):
    """Logarithmic decay (drops sharply early, then flattens):
    sigma_start - (sigma_start - sigma_end) * ln(1 + 9 t) / ln(10)."""

    def _shape(self, t: float) -> float:
        return self.sigma_start - (self.sigma_start - self.sigma_end) * math.log1p(9.0 * t) / math.log(10.0)


class OscillatingSchedule(NoiseController):
    """A decaying envelope with periodic re-heats, like simulated annealing.

    Envelope: sigma_env(s) = sigma_start * (sigma_end / sigma_start) ** (s / max_steps) (continuous).
    At each re-heat step j * period (j = 1, 2, ...) sigma jumps by a bump of height
    A_j = reheat_amplitude * reheat_decay ** (j - 1), times sigma_env(j * period) when ``relative``
    (so amplitude 1.0 doubles sigma) or in absolute sigma units otherwise; the bump then fades as
    exp(-(s - j * period) / reheat_width) until the next re-heat. Steps before ``warmup_steps`` are
    noise-free. ``stage`` is the number of re-heats so far.

    Args:
        sigma_start: Envelope at step 0.
        sigma_end: Envelope at max_steps.
        period: Steps between re-heats.
        reheat_amplitude: Height of the first re-heat (relative or absolute, see ``relative``).
        reheat_decay: Factor applied to each successive re-heat's height.
        reheat_width: e-folding steps of a re-heat's fade; None = period / 4.
        relative: Amplitude relative to the envelope (True) or an absolute sigma (False).
        warmup_steps: Leading steps with sigma = 0.
        max_steps: Total optimizer steps; None takes ``MonitorState.max_steps``.
    """

    def __init__(self, sigma_start: float = 1e-2, sigma_end: float = 5e-4, period: int = 100,
                 reheat_amplitude: float = 1.0, reheat_decay: float = 0.7, reheat_width: float | None = None,
                 relative: bool = True, warmup_steps: int = 0, max_steps: int | None = None) -> None:
        super().__init__()
        if period < 1:
            raise ValueError("period must be >= 1")
        _check("OscillatingSchedule", finite=dict(sigma_start=sigma_start, sigma_end=sigma_end,
                                                  reheat_amplitude=reheat_amplitude, reheat_decay=reheat_decay,
                                                  reheat_width=reheat_width),
               sigma_start__gt_0=sigma_start > 0, sigma_end__gt_0=sigma_end > 0,
               reheat_amplitude__ge_0=reheat_amplitude >= 0, reheat_decay__ge_0=reheat_decay >= 0,
               reheat_width__gt_0=reheat_width is None or reheat_width > 0, warmup_steps__ge_0=warmup_steps >= 0,
               max_steps__ge_1=max_steps is None or max_steps >= 1)
        self.sigma_start, self.sigma_end, self.period = float(sigma_start), float(sigma_end), int(period)
        self.reheat_amplitude, self.reheat_decay, self.relative = reheat_amplitude, reheat_decay, relative
        self.reheat_width = float(reheat_width) if reheat_width is not None else period / 4.0
        self.warmup_steps, self.max_steps = int(warmup_steps), max_steps
        self._prev_step: int | None = None  # the step of the previous call (for the logged reheat flag)

    def _envelope(self, step: int, max_steps: int) -> float:
        frac = min(max(step, 0) / max_steps, 1.0)
        return self.sigma_start * (self.sigma_end / self.sigma_start) ** frac

    def reheat_steps(self, max_steps: int) -> list[int]:
        """The steps at which a re-heat starts, below ``max_steps``."""
        return list(range(self.period, max_steps, self.period))

    def stage(self, step: int) -> int:
        return max(step, 0) // self.period

    def sigma(self, step: int, state: MonitorState | None = None) -> float:
        n = _max_steps(self.max_steps, state)
        if step < self.warmup_steps:
            self.last_decision = {"reheat": 0.0, "bump": 0.0}
            return 0.0
        env, j = self._envelope(step, n), self.stage(step)
        bump = 0.0
        if j >= 1:
            height = self.reheat_amplitude * self.reheat_decay ** (j - 1)
            if self.relative:
                height *= self._envelope(j * self.period, n)
            bump = height * math.exp(-(step - j * self.period) / self.reheat_width)
        # reheat = 1 at the first call in a new stage: with updates_per_rollout K > 1 the controller sees
        # every K-th step only, and a re-heat step j * period may fall between two calls
        prev, self._prev_step = self._prev_step, step
        started = step % self.period == 0 if prev is None or prev >= step else prev < j * self.period
        self.last_decision = {"reheat": float(j >= 1 and started), "bump": bump}
        return env + bump

    def state_dict(self) -> dict:
        return {"prev_step": self._prev_step}  # a resumed run logs aqn/reheat as the straight one

    def load_state_dict(self, state: dict) -> None:
        self._prev_step = state.get("prev_step")


def controller_settings(controller: NoiseController) -> dict:
    """A controller's class and settings (its public numbers, texts and flags; not the state its
    ``state_dict`` carries), a base controller's nested: what a resume compares."""
    state = set(getattr(controller, "_STATE", ())) | {"last_decision"}
    out: dict = {"class": type(controller).__name__}
    for key, value in vars(controller).items():
        if not key.startswith("_") and key not in state and isinstance(value, (bool, int, float, str, type(None))):
            out[key] = value
    if isinstance(getattr(controller, "base", None), NoiseController):
        out["base"] = controller_settings(controller.base)
    return out


class AdaptiveNoise(NoiseController):
    """Closed loop: boost a base schedule's sigma when the reward plateaus or the entropy collapses.

    The monitor counts in rollout batches (one ``sigma`` call and one reward / entropy entry per
    training step; with ``updates_per_rollout`` K a batch spans K optimizer steps, and the base
    schedule still reads the optimizer step). Each call with a full window of history takes the moving
    average (MA) of the last ``window`` mean rewards. An MA above the best MA so far by more than
    ``epsilon`` is an improvement (and ends a running boost: relax to the base). A plateau is ``window``
    batches without an improvement since the last improvement or the last boost; with
    ``entropy_floor`` set, an entropy MA below the floor also triggers. On a trigger sigma =
    max(base, clip(base * boost, sigma_min, sigma_max)) for ``cooldown`` batches (a boost never
    lowers sigma, also where the base schedule starts above ``sigma_max``). ``last_decision`` logs
    {"plateau": 0/1, "boost": applied factor, "base_sigma": the base schedule's sigma, "reward_ma", "entropy_ma"}. A repeated call for the same
    step returns the cached value.

    Args:
        base: Schedule being boosted; None = ExponentialSchedule().
        window: Rollout batches of the moving average, and of no improvement that make a plateau.
        epsilon: Smallest MA reward gain that counts as an improvement.
        boost: Factor applied to the base sigma during a boost.
        sigma_max: Upper bound of a boosted sigma.
        cooldown: Rollout batches a boost is held (unless the reward improves first).
        entropy_floor: Also boost while the entropy MA is below this; None disables.
        sigma_min: Lower bound of a boosted sigma (so a plateau in a noise-free stage still adds noise).
    """

    def __init__(self, base: NoiseController | None = None, window: int = 10, epsilon: float = 0.01,
                 boost: float = 2.0, sigma_max: float = 2e-2, cooldown: int = 10,
                 entropy_floor: float | None = None, sigma_min: float = 0.0) -> None:
        super().__init__()
        _check("AdaptiveNoise", finite=dict(epsilon=epsilon, boost=boost, sigma_min=sigma_min,  # (sigma_max .inf: no cap)
                                            entropy_floor=entropy_floor),
               window__ge_1=window >= 1, cooldown__ge_0=cooldown >= 0, epsilon__ge_0=epsilon >= 0,
               boost__gt_0=boost > 0, sigma_min__ge_0=sigma_min >= 0, sigma_max__ge_sigma_min=sigma_max >= sigma_min)
        self.base = base if base is not None else ExponentialSchedule()
        self.window, self.epsilon, self.boost, self.sigma_max = int(window), epsilon, boost, sigma_max
        self.cooldown, self.entropy_floor, self.sigma_min = int(cooldown), entropy_floor, sigma_min
        self.best_ma: float | None = None
        self.calls = 0  # rollout batches seen: the clock of the plateau logic (steps jump by K)
        self.clock: int | None = None  # the call of the last improvement or the last boost start
        self.boost_until = -1  # boosted while the call index < boost_until
        self.last_step: int | None = None
        self.last_sigma = 0.0

    def stage(self, step: int) -> int:
        return self.base.stage(step)

    def _ma(self, xs: Sequence[float]) -> float | None:
        return sum(xs[-self.window:]) / self.window if len(xs) >= self.window else None

    def sigma(self, step: int, state: MonitorState | None = None) -> float:
        if step == self.last_step:  # (the same step again: a resume from a checkpoint saved inside it)
            if state is not None:
                self.base.sigma(step, state)  # the base learns max_steps there, which stage() needs
            return self.last_sigma
        state = state if state is not None else MonitorState()
        base = self.base.sigma(step, state)
        t, self.calls = self.calls, self.calls + 1
        reward_ma, ent_ma = self._ma(state.rewards), self._ma(state.entropies)
        if reward_ma is not None:
            if self.best_ma is None or reward_ma > self.best_ma + self.epsilon:
                if self.best_ma is not None:
                    self.boost_until = min(self.boost_until, t)  # improving: relax to base
                self.best_ma, self.clock = reward_ma, t
        if t >= self.boost_until:
            stalled = self.clock is not None and t - self.clock >= self.window
            collapsed = self.entropy_floor is not None and ent_ma is not None and ent_ma < self.entropy_floor
            if stalled or collapsed:
                self.boost_until, self.clock = t + self.cooldown, t
        boosted = t < self.boost_until
        sigma = max(base, min(max(base * self.boost, self.sigma_min), self.sigma_max)) if boosted else base
        self.last_decision = {
            **self.base.last_decision,  # (an oscillating base's reheat / bump)
            "plateau": float(boosted),
            # the applied factor; none exists where sigma_min lifts a zero base (then NaN, a gap in
            # the curve, and aqn/base_sigma 0 beside aqn/sigma shows what happened)
            "boost": (sigma / base if base > 0 else float("nan") if sigma > 0 else 1.0) if boosted else 1.0,
            "base_sigma": base,
            "reward_ma": reward_ma if reward_ma is not None else float("nan"),
            "entropy_ma": ent_ma if ent_ma is not None else float("nan"),
        }
        self.last_step, self.last_sigma = step, sigma
        return sigma

    _STATE = ("best_ma", "calls", "clock", "boost_until", "last_step", "last_sigma", "last_decision")

    def state_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self._STATE}
        d["last_decision"] = dict(self.last_decision)
        d["base"] = self.base.state_dict()
        return d

    def load_state_dict(self, state: dict) -> None:
        for k in self._STATE:
            if k in state:
                setattr(self, k, state[k])
        self.last_decision = dict(self.last_decision)
        self.base.load_state_dict(state.get("base", {}))
