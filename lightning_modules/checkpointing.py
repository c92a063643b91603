"""What a checkpoint holds beyond Lightning's own state, and how a resume continues from it.

``QeRLModule`` checkpoints only its trainable tensors (LoRA, optional norms): the frozen base is
rebuilt from ``model`` on resume, so a file is megabytes, not the model. With them: the global RNG
(LoRA dropout draws from it) per rank, the silent-failure streaks and ``max_steps``. On resume the
config is what runs: a changed lr, betas, weight decay or max_steps replaces the restored one
(warned), and a checkpoint of another model or LoRA layout fails instead of loading nothing.
"""

from __future__ import annotations

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_modules.settings import apply_optimizer_settings
from qerl.seeding import global_rng_state, set_global_rng_state


class ResumeMixin:
    """Checkpoint hooks of ``QeRLModule`` (expects ``model``, ``optim_settings`` and ``_streaks``)."""

    _resume_rng: dict | None = None  # global RNG of a loaded checkpoint, restored at the next batch
    _checkpoint_max_steps: int | None = None  # a loaded checkpoint's trainer.max_steps
    checkpoint_step: int | None = None  # a loaded checkpoint's global_step (labels validate / test)

    def on_train_start(self) -> None:
        # after a resume restored the optimizer and scheduler: the config's lr, betas, weight decay
        # and max_steps are what runs (warned when they differ from the checkpoint's)
        for message in apply_optimizer_settings(self.optimizers().optimizer, self.lr_schedulers(), self.optim_settings,
                                                self.trainer.max_steps, self._checkpoint_max_steps):
            rank_zero_warn(message)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Keep only trainable parameters: the frozen base is rebuilt from ``model`` on resume. Also
        keep the global generators (LoRA dropout draws from them), restored at the next batch; under
        DDP every rank's (rank 0 writes the file, but the ranks' generators differ once they have
        drawn different amounts; every rank runs this hook, so the gather pairs up). And the
        silent-failure streaks (decided over all ranks, so one copy fits every rank): a run resumed
        in the middle of a failure still warns after ``warn_after_steps`` steps in all."""
        trainable = {n for n, p in self.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint["qerl_rng"] = global_rng_state()
        checkpoint["qerl_streaks"] = dict(self._streaks)
        checkpoint["qerl_max_steps"] = self._trainer.max_steps if self._trainer is not None else None
        if self._world_size() > 1:
            states = [None] * self._world_size()
            torch.distributed.all_gather_object(states, checkpoint["qerl_rng"])
            checkpoint["qerl_rng_per_rank"] = states

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # strict_loading is off (the frozen base is not in the file): check the trainable tensors by
        # hand, or a checkpoint of another model or LoRA layout would load nothing and run the base
        trainable = {n for n, p in self.named_parameters() if p.requires_grad}
        saved = set(checkpoint.get("state_dict", {}))
        if self.model is not None and saved != trainable:
            missing, unexpected = sorted(trainable - saved), sorted(saved - trainable)
            raise ValueError(f"the checkpoint does not fit this model ({len(missing)} trainable tensors missing, e.g. "
                             f"{missing[:1]}; {len(unexpected)} unexpected, e.g. {unexpected[:1]}): model.model, "
                             "model.lora and its trainable_norms must be those of the run that wrote it")
        self._streaks.update(checkpoint.get("qerl_streaks", {}))
        self._checkpoint_max_steps = checkpoint.get("qerl_max_steps")
        self.checkpoint_step = checkpoint.get("global_step")
        per_rank, world = checkpoint.get("qerl_rng_per_rank"), self._world_size()
        if per_rank is not None and len(per_rank) == world:
            self._resume_rng = per_rank[self.global_rank]
        else:  # one process, or a different world size: one state for all
            self._resume_rng = checkpoint.get("qerl_rng")

    def _world_size(self) -> int:
        trainer = self._trainer
        return int(trainer.world_size) if trainer is not None else 1

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        # restored here, not at load: Lightning draws from the global generator in between (the
        # dataloader iterator's base seed), which the uninterrupted run did before its first batch;
        # and not in on_train_batch_start, which runs after the callbacks' (the rollout and its
        # reward functions may draw from the global generators: a sampling judge, a verifier).
        # (on_before_batch_transfer belongs to the DataModule: it counts consumed batches there.)
        if self._resume_rng is not None and self._trainer is not None and self.trainer.training:
            set_global_rng_state(self._resume_rng)
            self._resume_rng = None
        return batch
