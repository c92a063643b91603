"""Checkpoint file names that say which optimizer step they hold.

``QeRLModule`` logs a ``step`` value (the optimizer step a rollout batch *started* at) so that every
scalar of the batch lands on one TensorBoard x-axis. Lightning's ``ModelCheckpoint`` reads that same
logged value for the ``{step}`` of its file names, but saves at the batch's *end*, after
``updates_per_rollout`` more optimizer steps: ``epoch=0-step=0.ckpt`` would hold ``global_step`` 2
with two updates per rollout. ``StepCheckpoint`` names files by ``trainer.global_step``, the step a
resume continues from; ``QeRLModule.configure_callbacks`` turns the plain ``ModelCheckpoint`` of a
YAML into one (a subclass of its own stays as it is).
"""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from callbacks.summary import adopt_subclass


class StepCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``{step}`` (file names, ``monitor: step``) is ``trainer.global_step``."""

    def _monitor_candidates(self, trainer) -> dict[str, torch.Tensor]:
        candidates = super()._monitor_candidates(trainer)
        candidates["step"] = torch.tensor(trainer.global_step)
        return candidates


def use_step_checkpoints(callbacks: list) -> None:
    """Every plain ``ModelCheckpoint`` in ``callbacks`` becomes a ``StepCheckpoint``, in place."""
    adopt_subclass(callbacks, ModelCheckpoint, StepCheckpoint)
