"""Entry point: ``python train.py fit --config configs/quickstart.yaml`` (also validate / test,
``--print_config``, ``--ckpt_path last``). LightningCLI only: every knob lives in the YAML."""

import argparse
import glob
import logging
import math
import os
import re
import sys
import warnings

import torch
import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_modules.checkpointing import TrainingDiverged
from lightning_modules.data import PromptDataModule
from lightning_modules.evaluation import claim_unused_path
from lightning_modules.qerl_module import QeRLModule
from qerl import drop_log_lines
from qerl.rollout.base import NonFiniteLogits
from qerl.settings_checks import require_full_precision

# Two lines on every fit that say nothing about the run (installed once, at import): Lightning's advert
# for its cloud logger, and the FutureWarning torch >= 2.13 raises on Lightning's own use of `LeafSpec`.
drop_log_lines("lightning.pytorch.utilities.rank_zero", "💡 Tip: For seamless cloud logging")
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)


_UNION_LIST = re.compile(r"Does not validate against any of the Union subtypes Subtypes: .*? Errors: - ")
_OTHER_REASONS = re.compile(r" - Expected a | Given value type: | - Not a valid subclass ")


def condensed(message: str) -> str:
    """jsonargparse's error without the noise: a union error lists every subtype it tried, each
    one's reason and the whole given value (the callback list with object addresses), nested once
    per level (a callback's controller). One line: the keys and the first reason at each level."""
    folded = " ".join(message.split())  # (one line also for the plain `Parser key "x": Expected ...`)
    configs = _config_paths(sys.argv[1:])
    if len(configs) == 1:  # a YAML syntax error names the string jsonargparse parsed, not the file
        folded = folded.replace('"<unicode string>"', configs[0])
    if "Does not validate against any of the Union subtypes" not in folded:
        return folded
    folded = _UNION_LIST.sub("", folded)  # every level's subtype list goes
    return _OTHER_REASONS.split(folded, maxsplit=1)[0].strip()  # the first reason, not the alternatives


def _config_paths(argv: list[str]) -> list[str]:
    """The files given with ``--config X`` / ``--config=X`` / ``-c X`` on a command line."""
    paths = [arg.split("=", 1)[1] for arg in argv if arg.startswith(("--config=", "-c="))]
    return paths + [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in ("--config", "-c")]


class QeRLParser(LightningArgumentParser):
    """A bad option or value is one ``error:`` line, not the ~70-line usage above it."""

    def error(self, message: str, ex: Exception | None = None):
        if self.exit_on_error and os.environ.get("QERL_TRACEBACK", "0") != "1":
            sys.stderr.write(f"error: {condensed(message)}  (--help lists the options)\n")
            self.exit(2)
        super().error(message, ex)


# The sections of a config that hold a class's settings: anything but a mapping there (`trainer: 5`,
# `data: [1, 2]`, or an empty `model:`, which YAML reads as null) was a TypeError deep in jsonargparse.
_SECTIONS = ("trainer", "model", "data")


def check_sections(config) -> None:
    """A ValueError naming the first section of a parsed (subcommand) config that is not a mapping."""
    for key in _SECTIONS:
        value = config.get(key) if key in config else {}
        if not hasattr(value, "items"):  # (a jsonargparse Namespace or a dict)
            got = "null (an empty section?)" if value is None else f"{type(value).__name__} {value!r}"[:80]
            raise ValueError(f"the config's `{key}` section must be a mapping of its settings (`{key}:` with keys "
                             f"under it), got {got}")


def _read_yaml_mapping(path: str) -> dict:
    """The top-level mapping of a config file as YAML reads it; {} when it cannot be read (jsonargparse
    reports a missing file or a syntax error, naming the file). An empty file, one of comments only or
    one whose top level is a list or a scalar was jsonargparse's "Unexpected config: <the text>"."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return {}
    if raw is None:
        raise ValueError(f"config file {path} is empty (or only comments): it needs sections such as model:, "
                         "data:, trainer: (configs/quickstart.yaml is one)")
    if not isinstance(raw, dict):
        raise ValueError(f"config file {path}: the top level must be a mapping of sections (model:, data:, "
                         f"trainer:, ...), got {type(raw).__name__}")
    return raw


def check_seed_everything(seed) -> None:
    """``seed_everything``: true (a random seed), false (none) or an integer numpy can seed with; an
    integer outside that range was Lightning's ValueError naming no key."""
    if seed is None or isinstance(seed, bool):
        return
    if not isinstance(seed, int) or not 0 <= seed <= _MAX_NUMPY_SEED:
        raise ValueError(f"seed_everything must be an integer in [0, {_MAX_NUMPY_SEED}] (what numpy seeds) or true "
                         f"(a random one), got {seed!r}")


_MAX_NUMPY_SEED = 2**32 - 1


def check_trainer_settings(trainer) -> None:
    """Trainer values Lightning takes and fails on only later: ``val_check_interval`` 0 ran a training
    step and then divided by it (a ZeroDivisionError from Lightning's loop); a negative or NaN one
    never validates. (A time, or a float, which Lightning refuses itself here: its own checks.) And
    ``precision`` (``require_full_precision``), before the model loads; ``gradient_clip_val`` and
    ``accumulate_grad_batches``, which Lightning refuses for a manually optimized module with a hint
    that does not apply (the module's own settings do that)."""
    require_full_precision(trainer.get("precision") if trainer is not None else None)
    # the module optimizes by hand (K updates per rollout batch): Lightning's own clipping and accumulation
    # refuse it with "switch to automatic optimization", which is not the way here
    for key, neutral, own in (
            ("gradient_clip_val", 0, "model.optimizer.max_grad_norm"),
            ("accumulate_grad_batches", 1, "model.loss.micro_batch_size (gradients accumulate over micro-batches)")):
        if trainer is not None and trainer.get(key) not in (None, neutral):
            raise ValueError(f"trainer.{key} is Lightning's and does not apply to this module (it optimizes by hand): "
                             f"use {own}")
    value = trainer.get("val_check_interval") if trainer is not None else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return  # None, or a time ("DD:HH:MM:SS", a timedelta or its dict): Lightning's to check
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"trainer.val_check_interval must be > 0 (an int: every N training batches; or a time, "
                         f"'DD:HH:MM:SS'), got {value}")


def warn_if_never_validated(config) -> None:
    """Validation sets in a fit whose ``trainer.val_check_interval`` is null: Lightning then validates at
    each epoch's end, and the prompt stream has no end, so no evaluation ever ran, without a word."""
    trainer, data = config.get("trainer") or {}, config.get("data") or {}
    if data.get("val_sources") and trainer.get("val_check_interval") is None and trainer.get("limit_val_batches") != 0:
        warnings.warn("data.val_sources are set but trainer.val_check_interval is null: the prompt stream has no "
                      "epochs, so this fit never validates; set trainer.val_check_interval to a number of "
                      "training batches (e.g. 50)", stacklevel=2)


def _callbacks(config) -> list:
    """``trainer.callbacks`` of a parsed subcommand config as a list (a YAML may give one mapping)."""
    callbacks = config.get("trainer", {}).get("callbacks") or []
    return list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]


def check_single_callbacks(config) -> None:
    """One RolloutCallback and one AQNCallback per run (both hold checkpointed state: Lightning's
    answer to two was a RuntimeError traceback when the Trainer was built)."""
    callbacks = _callbacks(config)
    for name in ("RolloutCallback", "AQNCallback"):
        count = sum(str(getattr(cb, "class_path", "")).endswith(name) for cb in callbacks)
        if count > 1:
            raise ValueError(f"trainer.callbacks holds {count} {name}s: a run takes one (a YAML list and a "
                             "--trainer.callbacks+= on the command line add up)")


def checkpoint_dirs(config) -> list[str]:
    """The ``dirpath`` of every ModelCheckpoint in a parsed subcommand config (where ``last`` is); its
    sections are mappings (``QeRLCLI.parse_arguments`` checked them before ``_parse_ckpt_path`` runs)."""
    callbacks = _callbacks(config)
    return [str(cb.init_args.dirpath) for cb in callbacks if str(getattr(cb, "class_path", "")).endswith("Checkpoint")
            and getattr(getattr(cb, "init_args", None), "dirpath", None)]


def last_checkpoint(dirs: list[str]) -> str | None:
    """The file Lightning resumes ``--ckpt_path last`` from: of the ``last*.ckpt`` in the checkpoint
    callbacks' dirpaths (``ModelCheckpoint._find_last_checkpoints``: a ``.ckpt`` whose name starts with
    ``last``, e.g. ``last-v1.ckpt``), the one modified last, as its ``_checkpoint_connector`` picks it;
    None when there is none."""
    found = {os.path.normpath(p) for d in dirs for p in glob.glob(os.path.join(glob.escape(d), "last*.ckpt"))}
    found = {p for p in found if os.path.exists(p)}  # (a `save_last: link` whose target is gone: skipped)
    return max(found, key=os.path.getmtime) if found else None


def check_ckpt_path(subcommand: str, ckpt_path: str | None, dirs: list[str]) -> None:
    """A ``--ckpt_path`` that cannot serve the subcommand is a ValueError now, not a traceback later:
    a file that is a directory or not a readable Lightning checkpoint, also the one ``last`` resolves
    to (a run killed while writing it leaves a truncated zip); ``last`` for validate / test when the
    checkpoint folders hold none or the config names none (Lightning would evaluate the untrained
    model). ``fit`` with ``last`` and nothing saved yet starts from scratch, as Lightning does, with a
    warning that says where it looked (and which other checkpoints are there)."""
    if not ckpt_path or ckpt_path in ("best", "hpc", "registry") or ckpt_path.startswith("registry:"):
        return
    if ckpt_path == "last":
        last = last_checkpoint(dirs)
        if last is not None:
            _check_checkpoint_file(last, f"--ckpt_path last ({last}, the newest last*.ckpt)", subcommand)
        elif subcommand == "fit":  # resume-or-start (a requeued job): said plainly, in place of Lightning's hint
            others = sorted({os.path.basename(f) for d in dirs for f in glob.glob(os.path.join(d, "*.ckpt"))})
            where = (f"in {', '.join(dirs)}" if dirs else
                     "(no ModelCheckpoint dirpath: each run saves into a new version folder, so `last` finds nothing)")
            rank_zero_warn(f"--ckpt_path last: no last*.ckpt {where}: this fit starts from step 0"
                           + (f"; other checkpoints there ({', '.join(others[:3])}): name one to resume from it"
                              if others else ""))
            warnings.filterwarnings("ignore", message=r'\.fit\(ckpt_path="last"\) is set, but there is no last checkpoint')
            return
        elif not dirs:  # Lightning would find no `last` and evaluate the untrained model
            raise ValueError("--ckpt_path last: no ModelCheckpoint with a dirpath in the config, so nothing says "
                             "where `last` is: name the .ckpt file (or add the run's ModelCheckpoint)")
        else:
            raise ValueError(f"--ckpt_path last: no last*.ckpt in {', '.join(dirs)}: nothing to {subcommand} "
                             "(leave --ckpt_path out to evaluate the configured model)")
        return
    if "://" not in ckpt_path and not os.path.exists(ckpt_path):  # (a URL is Lightning's to fetch)
        raise ValueError(f"--ckpt_path {ckpt_path}: no such file (before the model loads, not after)")
    _check_checkpoint_file(ckpt_path, f"--ckpt_path {ckpt_path}", subcommand)


def _check_checkpoint_file(path: str, label: str, subcommand: str) -> None:
    """``label`` (the option, and for ``last`` the file it names) in a ValueError when ``path`` is a
    directory or a file that is not a readable Lightning checkpoint, or, for ``fit``, one saved with
    ``save_weights_only`` (no optimizer or loop state to resume; validate / test can use it); a URL
    is left to Lightning."""
    if os.path.isdir(path):
        raise ValueError(f"{label} is a directory: name a .ckpt file (or last)")
    if os.path.isfile(path):
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=False)  # megabytes: only the trainable tensors
        except Exception as err:  # noqa: BLE001 - any unreadable file: the same one-line answer
            first = str(err).splitlines()[0] if str(err) else ""
            raise ValueError(f"{label} is not a readable checkpoint ({type(err).__name__}: {first})") from err
        if not isinstance(ckpt, dict) or not {"state_dict", "pytorch-lightning_version"} <= set(ckpt):
            raise ValueError(f"{label} is not a Lightning checkpoint (no state_dict and "
                             "pytorch-lightning_version: a torch.save file of something else?)")
        if subcommand == "fit" and "optimizer_states" not in ckpt:
            raise ValueError(f"{label} holds weights only (ModelCheckpoint save_weights_only): no optimizer or "
                             "loop state to resume from; validate / test take it, and model.adapter_path takes "
                             "`python -m qerl.export --format adapter --adapter <file>` of it to start a new run")


_NOT_OURS = ("optimizer", "lr_scheduler")


class QeRLCLI(LightningCLI):
    """LightningCLI where the config is what runs, whichever ``--ckpt_path`` is given.

    Lightning's CLI replaces every ``model.*`` value with the checkpoint's saved hyperparameters
    when ``--ckpt_path`` names a file (not for ``last``): a resume with a new lr or a validate with
    more samples would silently run the checkpoint's values. Here the config (YAML and command line)
    wins for ``last`` and files alike; ``QeRLModule.on_load_checkpoint`` warns each value that
    differs from the checkpoint's (``--config <log_dir>/config.yaml`` reruns with the run's own).
    A ``--ckpt_path`` that cannot serve the subcommand fails here (``check_ckpt_path``), and so do a
    config section that is not a mapping and trainer values Lightning fails on only after a training
    step (``check_sections``, ``check_trainer_settings``), before anything is built."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """fit, validate and test: ``predict`` needs a forward over batches, which a policy trained by
        rollouts has no use for (evaluation generates in validate / test)."""
        return {name: args for name, args in LightningCLI.subcommands().items() if name != "predict"}

    def add_arguments_to_parser(self, parser) -> None:
        # Configs saved by earlier versions hold `optimizer: null` / `lr_scheduler: null` (Lightning's
        # auto-configured options, now off): accepted there and hidden; a value is refused below
        for key in _NOT_OURS:
            parser.add_argument(f"--{key}", default=None, help=argparse.SUPPRESS)

    def parse_arguments(self, parser, args) -> None:
        # each --config file as written: a command-line `--trainer.x` replaces a `trainer: 5` section
        # silently, and a file of one empty section (`model:`) is "Unexpected config" to jsonargparse
        argv = sys.argv[1:] if args is None else args
        for path in _config_paths(list(argv)) if isinstance(argv, (list, tuple)) else []:
            check_sections(_read_yaml_mapping(path))
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")  # (None under `main(run=False)`: the config is flat)
        config = self.config[subcommand] if subcommand else self.config
        check_seed_everything(config.get("seed_everything"))
        for key in _NOT_OURS:
            if config.get(key) is not None:
                raise ValueError(f"{key}: not used here: QeRLModule builds AdamW and its schedule from model.optimizer "
                                 "(lr, betas, weight_decay, warmup_ratio, schedule: cosine | linear | constant)")
        check_sections(config)
        check_trainer_settings(config.get("trainer"))
        if subcommand in ("fit", None):  # (None: `main(run=False)`, a flat config)
            warn_if_never_validated(config)
        check_single_callbacks(config)

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict:
        kwargs = super()._prepare_subcommand_kwargs(subcommand)
        if subcommand in ("validate", "test") and kwargs.get("verbose", True):
            # Lightning's results table lists every evaluation set's metrics under every dataloader's
            # column; the module prints one row per set instead (the eval report's markdown table)
            kwargs["verbose"] = False
            self.model.print_eval_table = True
        return kwargs

    def _parse_ckpt_path(self) -> None:
        subcommand = self.config.get("subcommand")
        if subcommand:
            config = self.config[subcommand]
            check_ckpt_path(subcommand, config.get("ckpt_path"), checkpoint_dirs(config))


# what a logger's version folder holds before the first batch: TensorBoard's event file, the configs
_STARTUP_LOG_FILES = re.compile(r"events\.out\.tfevents\..*|config(-\d+)?\.yaml|hparams\.yaml")


class SaveRunConfig(SaveConfigCallback):
    """The run's config next to its logs. With a logger every run has its own ``version_N`` folder;
    without one (``trainer.logger: false``) runs share the working directory, so a second run writes
    ``config-1.yaml`` instead of replacing the first run's ``config.yaml`` (as its adapter and
    reports get ``-1`` names). A run that fails before its first batch (a wrong model path, a missing
    data file) removes the version folder it made, which would show in TensorBoard as an empty run."""

    batch_started = False

    def on_train_batch_start(self, *args) -> None:
        self.batch_started = True

    on_validation_batch_start = on_test_batch_start = on_train_batch_start

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        log_dir = trainer.log_dir if trainer.logger is not None else None
        if self.batch_started or not trainer.is_global_zero or not log_dir or not os.path.isdir(log_dir):
            return
        if os.path.realpath(log_dir) == os.path.realpath(os.getcwd()):
            return  # (a logger writing into the working directory: never remove that)
        names = os.listdir(log_dir)
        if all(_STARTUP_LOG_FILES.fullmatch(n) and os.path.isfile(os.path.join(log_dir, n)) for n in names):
            for name in names:
                os.remove(os.path.join(log_dir, name))
            os.rmdir(log_dir)
            logging.getLogger("qerl").info(f"removed {log_dir}: the run stopped before its first batch")

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self.already_saved and self.save_to_log_dir and trainer.logger is None:
            log_dir = trainer.log_dir
            stem, suffix = os.path.splitext(self.config_filename)
            name = None
            if trainer.is_global_zero:
                name = os.path.basename(claim_unused_path(os.path.join(log_dir, stem), suffix)) + suffix
                if name != self.config_filename:
                    logging.getLogger("qerl").warning(f"{os.path.join(log_dir, self.config_filename)} holds an "
                                                      f"earlier run's config: this run's is {name}")
            self.config_filename = trainer.strategy.broadcast(name)
        super().setup(trainer, pl_module, stage)


class _CurrentStderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever ``sys.stderr`` is when it writes (as logging's last resort is), not
    the one it was made with: a capturing caller (pytest's capsys) closes and replaces that stream."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # (StreamHandler.__init__ assigns it)
        pass


def main(args=None, run: bool = True) -> LightningCLI:
    # our INFO lines (base weight bytes and trainable parameters, data set sizes, vLLM start) on stderr
    for name in ("qerl", "lightning_modules", "callbacks"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            handler = _CurrentStderrHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
    return QeRLCLI(
        QeRLModule,
        PromptDataModule,
        save_config_callback=SaveRunConfig,
        save_config_kwargs={"overwrite": True},  # (a logger's version_N folder is new; without one: SaveRunConfig)
        parser_class=QeRLParser,
        # QeRLModule builds its own AdamW + schedule (model.optimizer, manual optimization): no top-level
        # --optimizer / --lr_scheduler, which Lightning would ignore or apply to an empty parameter list
        auto_configure_optimizers=False,
        args=args,
        run=run,
    )


def cli_entry() -> None:
    """``main()`` for the shell: a bad value, a missing file, an unknown model path, a setting the
    machine cannot run (a GPU recipe on a CPU box) or a run that diverged (``TrainingDiverged``) is one
    line on stderr (exit 2) instead of a long traceback; ``QERL_TRACEBACK=1`` shows the traceback. A SIGTERM (a scheduler's preemption) stops
    after the current rollout batch, saves ``last`` and exits 143, not 0; a first Ctrl-C in fit does the
    same and exits 130 (``callbacks.checkpoint.CtrlCStopsAfterTheBatch``)."""
    try:
        main()
    except SIGTERMException as err:
        if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":  # once, not per DDP rank
            fit, step = "fit" in sys.argv[1:2], getattr(err, "qerl_validation_step", None)
            stopper = getattr(err, "qerl_signal", "SIGTERM")
            if fit and step is not None:  # (callbacks.checkpoint.StepCheckpoint)
                print(f"stopped by {stopper} inside the validation at step {step}: nothing saved, and a resume from "
                      f"a checkpoint of step {step} continues after that evaluation (`python train.py validate "
                      f"--ckpt_path <its file>` recomputes it); resume with --ckpt_path last", file=sys.stderr)
            else:
                print(f"stopped by {stopper}" + (" after a complete rollout batch (saved as `last` where the config saves "
                                              "last checkpoints): resume with --ckpt_path last" if fit else ""),
                      file=sys.stderr)
        sys.exit(130 if getattr(err, "qerl_signal", None) == "Ctrl-C" else 143)
    except (ValueError, OSError, ModuleNotFoundError, MisconfigurationException, TrainingDiverged,
            NonFiniteLogits) as err:
        if os.environ.get("QERL_TRACEBACK", "0") == "1":
            raise
        hint = ("; this config runs on a GPU (--trainer.accelerator cpu runs it here, slowly)"
                if "No supported gpu backend" in str(err) else "")
        print(f"error: {type(err).__name__}: {condensed(str(err))}{hint}  (QERL_TRACEBACK=1 shows the traceback)",
              file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli_entry()
