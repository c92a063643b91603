"""`RewardFunction`, the interface every reward in ``qerl.rewards`` implements, and the rate-limited
warning the rewards share.

A reward is called on arbitrary model output, so the interface itself guards the values: a reward
that returns the wrong number of values fails loudly, and a non-finite value scores 0.0 with a
rate-limited warning (one NaN would reach its group's advantages and skip the whole update).
"""

from __future__ import annotations

import logging
import math
import time

logger = logging.getLogger("qerl.rewards")  # (the rewards' logger: their warnings read as the rewards')

_warn_state = {"last": 0.0, "suppressed": 0}


def _warn_limited(message: str, interval_s: float = 30.0) -> None:
    """Log at most one warning per ``interval_s`` (RL batches can fail thousands of parses)."""
    now = time.monotonic()
    if now - _warn_state["last"] >= interval_s:
        n = _warn_state["suppressed"]
        extra = f" ({n} similar warnings suppressed)" if n else ""
        logger.warning("%s%s", message, extra)
        _warn_state["last"], _warn_state["suppressed"] = now, 0
    else:
        _warn_state["suppressed"] += 1


class RewardFunction:
    """Base class: ``__call__(completions, answers) -> list[float]`` (one reward per completion).

    Subclasses implement `compute`. After each call, ``last_components`` maps reward names to the
    per-completion values of that call (``{name: values}`` for a single function), so the trainer
    can log ``train/rewards/<name>`` without knowing the reward's structure.
    """

    name: str = "reward"

    def __init__(self) -> None:
        self.last_components: dict[str, list[float]] = {}

    def compute(self, completions: list[str], answers: list[str]) -> list[float]:
        """Return one float per completion; ``answers[i]`` is the parsed gold of completion i."""
        raise NotImplementedError

    def __call__(self, completions: list[str], answers: list[str]) -> list[float]:
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        values = [float(v) for v in self.compute(list(completions), list(answers))]
        if len(values) != len(completions):
            raise ValueError(f"{type(self).__name__}.compute returned {len(values)} rewards for {len(completions)} completions")
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            # one NaN would reach its group's advantages and the loss, and the whole update would be
            # skipped; a reward that cannot grade a completion gives 0, as a failed parse does
            _warn_limited(f"{type(self).__name__} returned {len(bad)} non-finite rewards of {len(values)} "
                          f"(first: completion {bad[0]}, {values[bad[0]]}): scored 0.0")
            values = [v if math.isfinite(v) else 0.0 for v in values]
        self.last_components = self._components(values)
        return values

    def _components(self, values: list[float]) -> dict[str, list[float]]:
        """Per-function values of the call that produced ``values``; composites override this."""
        return {self.name: values}
