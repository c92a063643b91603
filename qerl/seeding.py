"""The run's seed: components whose ``seed`` is left unset follow ``seed_everything``."""

from __future__ import annotations

import numbers
import os


def resolve_seed(seed: int | None, key: str) -> int:
    """``seed`` if given, else the seed of the run (``seed_everything`` of the CLI config, which
    Lightning exports as ``PL_GLOBAL_SEED`` before the classes are built), else 0. So changing
    ``seed_everything`` changes the prompt order, the rollout sampler and the AQN noise together,
    while an explicit per-component seed still pins that component alone. A given seed must be an
    integer in [0, 2**63) (torch's generators take int64); ``key`` names it in the error."""
    if seed is not None:
        check_seed(seed, key, " or null (seed_everything's)")
        return int(seed)
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def check_seed(seed, key: str, alternative: str = "") -> None:
    """A ValueError naming ``key`` unless ``seed`` is an integer in [0, 2**63)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**63:
        raise ValueError(f"{key} must be an integer in [0, 2**63){alternative}, got {seed!r}")


def warn_if_seed_changed(what: str, saved: int | None, current: int) -> None:
    """On resume: a component whose seed differs from the checkpoint's draws another stream from here on
    (its ``seed`` left null follows ``seed_everything``, which a resume may have changed)."""
    if saved is not None and int(saved) != current:
        import warnings

        warnings.warn(f"{what}: seed {current}, the checkpoint's {saved}: from here on the run differs from the one "
                      f"it resumes (its seed, or seed_everything, {saved} continues that one)", stacklevel=2)


def global_rng_state() -> dict:
    """Python's, NumPy's and torch's (CPU + CUDA) global generator states, in plain types (a
    ``weights_only`` checkpoint load accepts them)."""
    import random

    import numpy as np
    import torch

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
            "torch": torch.random.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_global_rng_state(state: dict) -> None:
    """Inverse of :func:`global_rng_state`."""
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.random.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
