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

import glob
import os
import signal
import sys
import threading

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from callbacks.summary import adopt_subclass
from lightning_modules.checkpointing import TrainingDiverged


class StepCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``{step}`` (file names, ``monitor: step``) is ``trainer.global_step``;
    with ``save_last``, ``last`` is the state a fit ends with (also when ``max_steps`` is not a
    multiple of ``every_n_train_steps``) and is saved when a SIGTERM stops the fit."""

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        # a fresh fit (ckpt_path is known only once the restore ran) into a folder that holds another
        # run's `last`: both runs' files sit side by side and `--ckpt_path last` resumes the newest
        earlier = sorted(glob.glob(os.path.join(self.dirpath, "last*.ckpt"))) if self.dirpath else []
        if trainer.ckpt_path is None and earlier:
            rank_zero_warn(f"{self.dirpath} already holds {', '.join(os.path.basename(p) for p in earlier)} of an earlier "
                           "run: this run's checkpoints go beside them and `--ckpt_path last` picks the newest file; "
                           "resume that run with --ckpt_path last, or give this one its own dirpath")

    def on_train_end(self, trainer, pl_module) -> None:
        # Lightning saves `last` at the end only when the run saved none: with max_steps 12 and a save
        # every 10, `last` would hold step 10 while the run (and its adapter/) ended at 12, and
        # `--ckpt_path last` would quietly evaluate or retrain from step 10
        if self.save_last and trainer.global_step > 0 and self._last_global_step_saved != trainer.global_step:
            self._save_last_file(trainer)
        super().on_train_end(trainer, pl_module)

    def _save_last_file(self, trainer) -> None:
        """``last`` as a file of this step (``save_last: link`` would link an older step's file)."""
        save_last, self.save_last = self.save_last, True
        try:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        finally:
            self.save_last = save_last

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, TrainingDiverged):  # weights not worth saving (and a save would raise
            return  # again, hiding the message that names the step to resume from)
        super().on_exception(trainer, pl_module, exception)  # save_on_exception, if asked for
        # Lightning raises SIGTERM's exception between training batches: the state is a whole
        # rollout batch's, worth a resume (another exception may land inside an update). Not inside
        # fit's validation: that `last` would resume after an evaluation that never finished; the
        # exception carries the step instead, for the CLI's message (``train.cli_entry``)
        if not (isinstance(exception, SIGTERMException) and trainer.state.fn == "fit"):
            return
        if trainer.validating:
            exception.qerl_validation_step = trainer.global_step
        elif self.save_last:
            self._save_last_file(trainer)

    def _monitor_candidates(self, trainer) -> dict[str, torch.Tensor]:
        candidates = super()._monitor_candidates(trainer)
        candidates["step"] = torch.tensor(trainer.global_step)
        return candidates


def use_step_checkpoints(callbacks: list) -> None:
    """Every plain ``ModelCheckpoint`` in ``callbacks`` becomes a ``StepCheckpoint``, in place."""
    adopt_subclass(callbacks, ModelCheckpoint, StepCheckpoint)


class CtrlCStopsAfterTheBatch(Callback):
    """During fit, a first Ctrl-C does what a SIGTERM does: the fit stops after the current rollout
    batch and ``StepCheckpoint`` saves ``last`` (Lightning's own KeyboardInterrupt lands anywhere, mid
    update, and saved nothing: every step since the last periodic checkpoint was lost). A second
    Ctrl-C aborts at once, saving nothing. The exception carries ``qerl_signal = "Ctrl-C"`` for the
    CLI's message (``train.cli_entry``). Installed only in the main thread (``signal`` allows no other)."""

    def __init__(self) -> None:
        self._previous = None
        self._trainer = None
        self.pressed = False

    def on_train_start(self, trainer, pl_module) -> None:
        if threading.current_thread() is threading.main_thread():
            self._trainer, self.pressed = trainer, False
            self._previous = signal.signal(signal.SIGINT, self._on_ctrl_c)

    def _on_ctrl_c(self, signum, frame) -> None:
        if self.pressed:
            self._restore()
            raise KeyboardInterrupt
        self.pressed = True
        # the flag a SIGTERM sets (Lightning's signal connector); the training loop checks it after each
        # batch, and under DDP rank 0's is broadcast to every rank
        self._trainer._signal_connector.received_sigterm = True
        if self._trainer.is_global_zero:
            print("\nCtrl-C: stopping after this rollout batch and saving `last` where the config saves last "
                  "checkpoints (Ctrl-C again stops now and saves nothing)", file=sys.stderr, flush=True)

    def _restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore()
        if self.pressed and isinstance(exception, SIGTERMException):
            exception.qerl_signal = "Ctrl-C"
