"""Entry point: ``python train.py fit --config configs/quickstart.yaml`` (also validate / test,
``--print_config``, ``--ckpt_path last``). LightningCLI only: every knob lives in the YAML."""

from lightning.pytorch.cli import LightningCLI

from lightning_modules.data import PromptDataModule
from lightning_modules.qerl_module import QeRLModule


def main(args=None, run: bool = True) -> LightningCLI:
    return LightningCLI(
        QeRLModule,
        PromptDataModule,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


if __name__ == "__main__":
    main()
