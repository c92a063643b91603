"""Entry point: ``python train.py fit --config configs/quickstart.yaml`` (also validate / test,
``--print_config``, ``--ckpt_path last``). LightningCLI only: every knob lives in the YAML."""

import logging
import os
import sys

from lightning.pytorch.cli import LightningCLI

from lightning_modules.data import PromptDataModule
from lightning_modules.qerl_module import QeRLModule


class QeRLCLI(LightningCLI):
    """LightningCLI where the config is what runs, whichever ``--ckpt_path`` is given.

    Lightning's CLI replaces every ``model.*`` value with the checkpoint's saved hyperparameters
    when ``--ckpt_path`` names a file (not for ``last``): a resume with a new lr or a validate with
    more samples would silently run the checkpoint's values. Here the config (YAML and command line)
    wins for ``last`` and files alike; ``QeRLModule.on_load_checkpoint`` warns each value that
    differs from the checkpoint's (``--config <log_dir>/config.yaml`` reruns with the run's own)."""

    def _parse_ckpt_path(self) -> None:
        return None


def main(args=None, run: bool = True) -> LightningCLI:
    # our INFO lines (base weight bytes and trainable parameters, data set sizes, vLLM start) on stderr
    for name in ("qerl", "lightning_modules", "callbacks"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
    return QeRLCLI(
        QeRLModule,
        PromptDataModule,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def cli_entry() -> None:
    """``main()`` for the shell: a bad value, a missing file or an unknown model path is one line on
    stderr (exit 2) instead of a long traceback; ``QERL_TRACEBACK=1`` shows the traceback."""
    try:
        main()
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as err:
        if os.environ.get("QERL_TRACEBACK", "0") == "1":
            raise
        print(f"error: {type(err).__name__}: {err}  (QERL_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli_entry()
