"""The run's seed: components whose ``seed`` is left unset follow ``seed_everything``."""

from __future__ import annotations

import os


def resolve_seed(seed: int | None) -> int:
    """``seed`` if given, else the seed of the run (``seed_everything`` of the CLI config, which
    Lightning exports as ``PL_GLOBAL_SEED`` before the classes are built), else 0. So changing
    ``seed_everything`` changes the prompt order, the rollout sampler and the AQN noise together,
    while an explicit per-component seed still pins that component alone."""
    if seed is not None:
        return int(seed)
    return int(os.environ.get("PL_GLOBAL_SEED", 0))
