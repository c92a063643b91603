"""Lightning's model summary with the real size of the weights, and its progress bar without "Epoch 0/-2".

Lightning estimates "params size" as parameters x 4 bytes, which for a frozen NVFP4 base
(0.5625 B per weight: packed e2m1 codes + e4m3 block scales) or NF4 overstates the memory the
run holds by up to 7x. ``WeightBytesSummary`` prints the same table with the bytes the tensors
actually occupy; ``QeRLModule.configure_callbacks`` puts it in place of Lightning's default summary
(``trainer.enable_model_summary: false`` still turns the summary off; a custom summary stays).

Training here is one endless epoch of the prompt stream bounded by ``trainer.max_steps``, so
Lightning sets ``max_epochs = -1`` and its rich bar reads "Epoch 0/-2": ``StepProgressBar`` names
the bar "Epoch 0" there (its count is rollout batches) and is swapped in the same way.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import ModelSummary, RichModelSummary, RichProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

from qerl.quantize import base_weight_bytes, count_parameters, is_lora_parameter

_Base = RichModelSummary if _RICH_AVAILABLE else ModelSummary


def replace_default_summary(callbacks: list) -> None:
    """Swap Lightning's own summary in ``callbacks`` (as ``enable_model_summary`` adds it) for a
    ``WeightBytesSummary`` of the same depth, in place; leave the list alone when the summary is
    off or a custom one. (In place rather than returned from ``configure_callbacks``, which would
    make Lightning print an "will override existing callbacks" line on every run.)"""
    at = [i for i, cb in enumerate(callbacks) if isinstance(cb, ModelSummary)]
    if len(at) == 1 and type(callbacks[at[0]]) in (ModelSummary, RichModelSummary):
        callbacks[at[0]] = WeightBytesSummary(max_depth=callbacks[at[0]]._max_depth)


def weight_megabytes(pl_module) -> float:
    """MB held by the module's parameters: everything ``base_weight_bytes`` counts (the base as
    stored: NVFP4 packed, NF4 with its absmax state; trainable norms included) plus the LoRA tensors
    it leaves out."""
    model = getattr(pl_module, "model", None) or pl_module
    lora = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if is_lora_parameter(n))
    return (base_weight_bytes(model)["total"] + lora) / 1e6


class WeightBytesSummary(_Base):
    """Lightning's (rich) model summary; "Total estimated model params size" is the real weight bytes,
    and the parameter counts are the logical ones (Lightning counts an NF4 weight's packed bytes,
    two codes each: half its elements)."""

    def on_fit_start(self, trainer, pl_module) -> None:
        self._megabytes = weight_megabytes(pl_module)
        self._module = pl_module
        super().on_fit_start(trainer, pl_module)

    def summarize(self, summary_data, total_parameters, trainable_parameters, model_size, *args, **kwargs) -> None:
        counts = count_parameters(self._module)
        names = dict(summary_data).get("Name", [])
        for header, values in summary_data:  # each listed module's own count, where it names one
            if header == "Params":
                for i, name in enumerate(names):
                    try:
                        values[i] = get_human_readable_count(count_parameters(self._module.get_submodule(name))["total"])
                    except AttributeError:  # (a "leftover params" row)
                        pass
        super().summarize(summary_data, counts["total"], counts["trainable"], self._megabytes, *args, **kwargs)


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar; no "/-2" after the epoch when only max_steps bounds the run."""

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"  # padded as Lightning does
        return super()._get_train_description(current_epoch)


def adopt_subclass(callbacks: list, lightning_class: type, subclass: type) -> None:
    """Make every callback in ``callbacks`` that is exactly ``lightning_class`` a ``subclass``, in
    place. For subclasses that add no state: every argument the YAML gave stays (rebuilding would
    have to copy them, and returning new ones from ``configure_callbacks`` makes Lightning print an
    "override" line on every run); a user's own subclass stays as it is."""
    for cb in callbacks:
        if type(cb) is lightning_class:
            cb.__class__ = subclass


def replace_default_progress_bar(callbacks: list) -> None:
    """Lightning's own rich progress bar in ``callbacks`` becomes a ``StepProgressBar``."""
    adopt_subclass(callbacks, RichProgressBar, StepProgressBar)

