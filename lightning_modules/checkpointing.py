"""What a checkpoint holds beyond Lightning's own state, and how a resume continues from it.

``QeRLModule`` checkpoints only its trainable tensors (LoRA, optional norms): the frozen base is
rebuilt from ``model`` on resume, so a file is megabytes, not the model. With them: the global RNG
(LoRA dropout draws from it) per rank, the silent-failure streaks and ``max_steps``. On resume the
config is what runs: a changed lr, betas, weight decay or max_steps replaces the restored one
(warned, like every other model setting that differs from the checkpoint's), and a checkpoint of
another model or LoRA layout, of another built-in tiny model or seed, or together with an
``adapter_path`` the run did not start from, fails instead of training on something else. A validation inside fit leaves the
training RNG stream as it found it, so a resume from that step draws what the straight run draws.
"""

from __future__ import annotations

import dataclasses

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_modules.settings import apply_optimizer_settings, decay_flags, hparam_differences, split_one_group_state
from qerl.adapter import non_finite_tensors, refuse_non_finite
from qerl.model import TINY_MODEL_NAMES
from qerl.seeding import global_rng_state, set_global_rng_state


# QeRLModule arguments that shape training only, not the weights an evaluation runs (validate /
# test against a checkpoint do not compare them)
_TRAINING_ONLY = ("loss", "optimizer", "gradient_checkpointing", "warn_after_steps", "fused_ops", "cudnn_attention")


class TrainingDiverged(RuntimeError):
    """The run cannot go on: its weights give, or are, non-finite values. ``train.py`` prints it as one
    line; no checkpoint of such weights is written (the step that made them raises before its save)."""


class ResumeMixin:
    """Checkpoint hooks of ``QeRLModule`` (expects ``model``, ``optim_settings`` and ``_streaks``)."""

    _resume_rng: dict | None = None  # global RNG of a loaded checkpoint, restored at the next batch
    _checkpoint_max_steps: int | None = None  # a loaded checkpoint's trainer.max_steps
    checkpoint_step: int | None = None  # a loaded checkpoint's global_step (labels validate / test)
    _rng_after_batch: dict | None = None  # the global RNG at the end of the last training batch

    def on_train_start(self) -> None:
        self._fit_start_step = self.global_step  # (0, or the resumed checkpoint's step)
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
        trainable = self._trainable_shapes()
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        if bad := non_finite_tensors(checkpoint["state_dict"]):  # (a last line of defence: the update guards)
            raise TrainingDiverged(f"not saving a checkpoint of non-finite weights ({len(bad)} tensors, e.g. {bad[0]})")
        trainer = self._trainer
        if trainer is not None and trainer.state.fn == "fit" and trainer.validating and self._rng_after_batch is not None:
            # saved as a validation ends (a keep-best ModelCheckpoint), after it drew from the
            # generators: the training stream as the straight run continues it (on_validation_end)
            checkpoint["qerl_rng"] = self._rng_after_batch
        else:
            checkpoint["qerl_rng"] = global_rng_state()
        checkpoint["qerl_streaks"] = dict(self._streaks)
        checkpoint["qerl_cudnn_failed"] = self._cudnn_failed  # (a resumed run stays off cuDNN attention too)
        checkpoint["qerl_settings"] = self._resolved_settings()
        checkpoint["qerl_base"] = self.base_record()
        checkpoint["qerl_max_steps"] = self._trainer.max_steps if self._trainer is not None else None
        if self._world_size() > 1:
            states = [None] * self._world_size()
            torch.distributed.all_gather_object(states, checkpoint["qerl_rng"])
            checkpoint["qerl_rng_per_rank"] = states

    def check_weights_finite(self) -> None:
        """After an optimizer step: a finite gradient can still make weights non-finite (an overflowing
        lr or weight decay); stop before this step's checkpoint is saved, naming the last good step."""
        params = self.trainable_parameters()
        norms = torch.stack([n.float() for n in torch._foreach_norm(params)]) if params else None
        if norms is None or bool(torch.isfinite(norms).all()):  # (one sync per update)
            return
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        bad = non_finite_tensors(dict(zip(names, params))) or [names[int((~torch.isfinite(norms)).nonzero()[0])]]
        step = self.global_step  # (the optimizer step has counted)
        raise TrainingDiverged(
            f"training diverged: optimizer step {step} made {len(bad)} of {len(params)} trainable tensors non-finite "
            f"or overflowing (e.g. {bad[0]}) from a finite gradient: model.optimizer.lr or weight_decay too large? "
            f"Nothing of step {step} is saved; resume from a checkpoint of step {step - 1} or earlier with a smaller lr")

    def non_finite_gradients(self) -> str:
        """Which trainable tensors hold a non-finite gradient, for the warning of a skipped update
        (read only then): how many, and the first, e.g. the lowest layer it reached."""
        grads = {n: p.grad for n, p in self.model.named_parameters() if p.requires_grad and p.grad is not None}
        bad = non_finite_tensors(grads)
        return f"{len(bad)} of {len(grads)} gradients, first {bad[0]}" if bad else "the norm overflowed"

    def skipped_streak_error(self, what: str) -> TrainingDiverged:
        """What stops a run whose last updates all had a non-finite ``what`` (loss or gradient norm):
        skipped, they left the weights of the streak's first step, which give them."""
        skipped = self._streaks["skipped"]
        first = self.global_step - skipped
        head = f"training diverged: the {skipped} updates since step {first} all had a non-finite {what}"
        if first <= getattr(self, "_fit_start_step", 0):  # no update of this run came before: not the lr
            return TrainingDiverged(f"{head}, from the weights this run started with (step {first}): check the "
                                    "base model, the AQN noise and the rewards before the lr")
        return TrainingDiverged(f"{head} (skipped, so the weights are still those of step {first}): a too large "
                                f"model.optimizer.lr, or rewards? Checkpoints of step {first} and later hold those "
                                f"weights: resume from an earlier one with a smaller lr")

    def base_record(self) -> dict:
        """The base this run builds ({"model", "dtype", "seed", "quantization"}): saved with checkpoints
        (``qerl_base``) and the final adapter (``qerl_base.json``), read back by resume, by
        ``model.adapter_path`` and by ``python -m qerl.export``."""
        return {"model": self.model_name, "dtype": self.dtype_name, "seed": self.seed, "quantization": self.quantization}

    def _settings_sections(self) -> dict:
        return {"lora": self.lora_settings, "loss": self.loss_settings, "optimizer": self.optim_settings,
                "eval": self.eval_settings}

    def _resolved_settings(self) -> dict:
        """The LoRA, loss, optimizer and eval settings that run, as dicts (hyper_parameters may hold
        None for a section: a config saved before the defaults were printed, or a module built in
        Python): saved as ``qerl_settings`` and compared on resume."""
        return {section: _plain(settings) for section, settings in self._settings_sections().items()}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # strict_loading is off (the frozen base is not in the file): check the trainable tensors by
        # hand, or a checkpoint of another model or LoRA layout would load nothing and run the base
        shapes = self._trainable_shapes()
        state = checkpoint.get("state_dict", {})
        saved = set(state)
        resized = sorted(n for n in saved & set(shapes) if tuple(state[n].shape) != shapes[n])
        if self.model is not None and (saved != set(shapes) or resized):
            missing, unexpected = sorted(set(shapes) - saved), sorted(saved - set(shapes))
            problems = [f"{len(names)} trainable tensors {what}, e.g. {names[0]}"
                        for names, what in ((missing, "missing"), (unexpected, "unexpected")) if names]
            if resized:
                problems.append(f"{len(resized)} of another shape, e.g. {resized[0]}: "
                                f"{tuple(state[resized[0]].shape)} saved, {shapes[resized[0]]} here")
            raise ValueError(f"the checkpoint does not fit this model ({'; '.join(problems)}): model.model, model.lora "
                             "(rank, targets) and its trainable_norms must be those of the run that wrote it")
        refuse_non_finite(state, "the checkpoint", "trainable tensors", "saved after its run diverged: resume from an earlier one")
        if self.model is not None and "optimizer_states" in checkpoint:  # written before the norm scales had their own undecayed group
            flags = decay_flags(self.trainable_parameters())
            before = checkpoint["optimizer_states"]
            checkpoint["optimizer_states"] = [split_one_group_state(state, flags) for state in before]
            split = any(len(a["param_groups"]) != len(b["param_groups"]) for a, b in zip(before, checkpoint["optimizer_states"]))
            if split and self.optim_settings.weight_decay > 0:
                rank_zero_warn("the checkpoint decayed the trainable norm scales (one AdamW group); from here on "
                               "they get no weight decay, so the resumed run differs slightly from its straight run")
        hparams = dict(checkpoint.get("hyper_parameters") or {})
        self._check_same_base(checkpoint.get("qerl_base") or {"model": hparams.get("model"), "seed": hparams.get("seed")})
        if self.adapter_path and self.adapter_path != hparams.get("adapter_path"):
            raise ValueError(f"model.adapter_path {self.adapter_path} with a checkpoint: the checkpoint's LoRA weights "
                             "would replace that adapter's; leave out one of them (a resume of a run that started "
                             "from an adapter names the same adapter_path)")
        saved = _plain(hparams)
        if "qerl_settings" in checkpoint:
            saved.update(checkpoint["qerl_settings"])
        else:  # written before the resolved settings were saved: what ran then
            saved = _with_older_defaults(saved)
        for section, current in self._settings_sections().items():  # a section its config left out ran the defaults
            if section in saved and saved[section] is None:
                saved[section] = _plain(type(current)())
        trained_alpha = (saved.get("lora") or {}).get("alpha")
        if trained_alpha is not None and self.lora_settings is not None and trained_alpha != self.lora_settings.alpha:
            # not a setting to change: alpha / rank scales every adapter output, so the weights would
            # give another model than the one trained (model.adapter_path refuses it the same way)
            raise ValueError(f"the checkpoint's LoRA was trained with model.lora.alpha={trained_alpha}, this config has "
                             f"{self.lora_settings.alpha}: the adapter's scale (alpha / rank) would change; set "
                             f"model.lora.alpha={trained_alpha}")
        config = {**_plain(dict(self.hparams)), **self._resolved_settings()}
        fitting = self._trainer is None or self.trainer.state.fn == "fit"
        ignored = ("eval",) if fitting else _TRAINING_ONLY + ("eval",)  # validate / test: only what the weights are
        differences = hparam_differences({k: v for k, v in config.items() if k not in ignored}, saved)
        if differences:  # `last` and a file alike (the CLI no longer swaps in the checkpoint's values)
            rank_zero_warn("the checkpoint was trained with other model settings; the config's are used:\n  "
                           + "\n  ".join(differences))
        eval_changes = hparam_differences({"eval": config["eval"]}, saved) if fitting else []
        if eval_changes:  # evaluating differently is no training difference, but the val curves change meaning
            rank_zero_warn("the resumed run evaluates with other settings than the checkpoint's run (its val/ "
                           "curves change meaning from here):\n  " + "\n  ".join(eval_changes))
        self._streaks.update(checkpoint.get("qerl_streaks", {}))
        self._cudnn_failed = bool(checkpoint.get("qerl_cudnn_failed", False))
        self._checkpoint_max_steps = checkpoint.get("qerl_max_steps")
        self.checkpoint_step = checkpoint.get("global_step")
        max_steps = self.trainer.max_steps if fitting and self._trainer is not None else -1
        if self.checkpoint_step is not None and 0 <= max_steps <= self.checkpoint_step:
            # (Lightning only logs "max_steps=N reached" and trains nothing)
            rank_zero_warn(f"the checkpoint is at step {self.checkpoint_step} and trainer.max_steps is {max_steps}: this "
                           "fit trains nothing; raise trainer.max_steps to continue the run")
        per_rank, world = checkpoint.get("qerl_rng_per_rank"), self._world_size()
        if per_rank is not None and len(per_rank) == world:
            self._resume_rng = per_rank[self.global_rank]
        else:  # one process, or a different world size: one state for all
            self._resume_rng = checkpoint.get("qerl_rng")

    def _check_same_base(self, base: dict, what: str = "the checkpoint") -> None:
        """A built-in tiny model is a random init: the checkpoint's LoRA on another tiny model, or on
        the same one of another seed, would train or evaluate on weights it never saw (same shapes,
        so nothing else notices). Other model names only warn (a moved folder is the same model)."""
        model, seed = base.get("model"), base.get("seed")
        if model not in TINY_MODEL_NAMES or self.model_name not in TINY_MODEL_NAMES:
            return
        if model != self.model_name:
            raise ValueError(f"{what} was trained on {model}, this run builds {self.model_name}: its LoRA "
                             "fits the shapes but not the weights")
        if seed is not None and int(seed) != self.seed:
            raise ValueError(f"{what} was trained on {model} of seed {seed}, this run builds seed {self.seed} "
                             "(model.seed, else seed_everything): another random base; set the seed it ran with")

    def _check_adapter_base(self) -> None:
        """``model.adapter_path`` against the base it records (``qerl_base.json``; none: not written by
        qerl, then peft's ``base_model_name_or_path``, a warning if another): another tiny model or seed is an error, as on resume; another model
        name, dtype or quantization a warning (the adapter then runs on weights it did not train on)."""
        from qerl.adapter import check_adapter_dir, is_dequantized_base, read_base, read_peft_base, same_model

        check_adapter_dir(self.adapter_path)
        what = f"model.adapter_path {self.adapter_path}"
        base = read_base(self.adapter_path)
        if base is None:  # not written by qerl: peft's own record of the base, when it names one
            named = read_peft_base(self.adapter_path)
            if named and not same_model(named, str(self.model_name)):
                rank_zero_warn(f"{what} was trained on {named} (its adapter_config.json; no qerl_base.json), this "
                               f"run's model is {self.model_name}: if that is another model, its outputs here differ "
                               "from the trained model's")
            return
        self._check_same_base(base, what)
        here = self.base_record()
        keys = ("model", "dtype", "quantization")
        if self.quantization == "bf16" and is_dequantized_base(self.model_name, base):
            keys = ("dtype",)  # a --from-trained-base export of that base: the weights it trained on
        differing = [f"{key} {base[key]} (this run: {here[key]})" for key in keys
                     if base.get(key) is not None and str(base[key]) != str(here[key])
                     and not (key == "model" and same_model(str(base[key]), str(here[key])))]
        if differing:
            rank_zero_warn(f"{what} was trained on another base ({', '.join(differing)}): its outputs here differ "
                           "from the trained model's")

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        # the global RNG as a checkpoint of this step holds it (ModelCheckpoint saved just before)
        self._rng_after_batch = global_rng_state()

    def on_validation_end(self) -> None:
        # a validation inside fit must not move the training stream of random numbers (the val
        # dataloader's seed, a sampling judge): a run resumed from this step's checkpoint, which
        # does not repeat the validation, would draw other LoRA-dropout masks than the straight run
        if self.trainer.state.fn == "fit" and not self.trainer.sanity_checking and self._rng_after_batch is not None:
            set_global_rng_state(self._rng_after_batch)

    def _trainable_shapes(self) -> dict[str, tuple[int, ...]]:
        """State-dict key -> shape of the tensors a checkpoint holds: LoRA and any trainable norms."""
        return {n: tuple(p.shape) for n, p in self.named_parameters() if p.requires_grad}

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


# Settings added later, with what checkpoints written before them (and before ``qerl_settings``)
# ran: a resume that now runs the new default is warned like any other difference.
OLDER_DEFAULTS = {("lora", "compute_dtype"): "stored",       # peft's fp32 LoRA forward (2026-12-01)
                  ("loss", "group_by_length"): False}         # micro-batches in rollout order


def _with_older_defaults(saved: dict) -> dict:
    for (group, key), value in OLDER_DEFAULTS.items():
        if group in saved and saved[group] is None:      # that section was not in the config: defaults ran
            saved[group] = {}
        if isinstance(saved.get(group), dict) and key not in saved[group]:
            saved[group] = {**saved[group], key: value}
    return saved


def _plain(value):
    """Settings as a checkpoint's hyper_parameters hold them: dataclasses as dicts (the CLI passes
    dicts already; a module built in Python holds the dataclass objects)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
