"""The model summary prints the bytes the weights really occupy (Lightning assumes 4 B per parameter)."""

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, RichModelSummary

import callbacks.summary as summary
from lightning_modules.qerl_module import QeRLModule
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

from qerl.quantize import base_weight_bytes, count_parameters
from qerl.nvfp4 import NVFP4WeightTensor


@pytest.mark.parametrize("quantization", ["nvfp4", "bf16", "nf4"])
def test_summary_size_is_the_real_weight_bytes(quantization, monkeypatch):
    if quantization == "nf4":
        pytest.importorskip("bitsandbytes")
    module = QeRLModule(model="tiny-qwen2", quantization=quantization, dtype="fp32")
    module.configure_model()
    printed = {}
    monkeypatch.setattr(summary._Base, "summarize", staticmethod(
        lambda data, total, trainable, size, *a, **k: printed.update(size=size, total=total, rows=dict(data))))
    trainer = L.Trainer(logger=False, accelerator="cpu", enable_progress_bar=False, enable_checkpointing=False)
    summary.WeightBytesSummary(max_depth=1).on_fit_start(trainer, module)
    params = list(module.model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    assert printed["size"] == pytest.approx((base_weight_bytes(module.model)["total"] + trainable) / 1e6)
    # the logical parameter count: Lightning's for NVFP4 / bf16; for NF4 (packed bytes, 2 codes each)
    # Lightning's would be half of each quantized weight
    logical = count_parameters(module)["total"]
    assert printed["total"] == logical and printed["rows"]["Params"][0] == get_human_readable_count(logical)
    if quantization == "nf4":
        assert sum(p.numel() for p in params) < logical
        return
    assert printed["total"] == sum(p.numel() for p in params)
    lightning_size = printed["total"] * 4 / 1e6  # what Lightning would have printed (32-bit)
    # fp32 model: the only difference is the packed NVFP4 linears (0.5625 B per weight instead of 4)
    packed = [p for p in params if isinstance(p, NVFP4WeightTensor)]
    assert bool(packed) == (quantization == "nvfp4")
    saved = sum(p.numel() * 4 - p.packed_nbytes() for p in packed) / 1e6
    assert lightning_size - printed["size"] == pytest.approx(saved)
    assert all(p.packed_nbytes() == p.numel() * 9 // 16 + 4 for p in packed)  # + the fp32 per-tensor scale


def test_replaces_only_lightnings_own_summary():
    for default in (ModelSummary(max_depth=2), RichModelSummary(max_depth=2)):
        cbs = [ModelCheckpoint(), default]
        summary.replace_default_summary(cbs)
        assert isinstance(cbs[1], summary.WeightBytesSummary) and cbs[1]._max_depth == 2
        assert isinstance(cbs[0], ModelCheckpoint)
    cbs = [ModelCheckpoint()]
    summary.replace_default_summary(cbs)                      # enable_model_summary: false
    assert len(cbs) == 1 and isinstance(cbs[0], ModelCheckpoint)

    class Custom(ModelSummary):
        pass

    cbs = [Custom()]
    summary.replace_default_summary(cbs)                      # a user's own summary stays
    assert type(cbs[0]) is Custom


def test_trainer_prints_no_override_line(monkeypatch):
    """The swap happens through configure_callbacks without Lightning's "will override" info line."""
    import lightning.pytorch.trainer.connectors.callback_connector as connector

    said = []
    monkeypatch.setattr(connector, "rank_zero_info", lambda msg, *a, **k: said.append(msg))
    module = QeRLModule(model="tiny-qwen2", quantization="bf16", dtype="fp32")
    trainer = L.Trainer(logger=False, accelerator="cpu", enable_progress_bar=False, enable_checkpointing=False,
                        max_steps=0)
    trainer.strategy.connect(module)
    module.trainer = trainer                                   # as fit() does before attaching
    trainer._callback_connector._attach_model_callbacks()
    assert not any("override" in m for m in said), said
    assert sum(isinstance(cb, summary.WeightBytesSummary) for cb in trainer.callbacks) == 1
    assert not any(type(cb) in (ModelSummary, RichModelSummary) for cb in trainer.callbacks)


def test_trainable_norms_are_counted_once():
    from qerl.model import LoraSettings

    module = QeRLModule(model="tiny-qwen2", quantization="bf16", dtype="fp32", lora=LoraSettings(rank=4, trainable_norms=True))
    module.configure_model()
    params = list(module.model.parameters())
    assert any(p.requires_grad and p.dim() == 1 for p in params)  # the norms train
    assert summary.weight_megabytes(module) == pytest.approx(sum(p.numel() * p.element_size() for p in params) / 1e6)


def test_progress_bar_of_a_max_steps_run_reads_epoch_0():
    """max_steps bounds the run, so Lightning's max_epochs is -1 and its rich bar would say "Epoch 0/-2"."""
    from lightning.pytorch.callbacks import RichProgressBar

    bar = RichProgressBar()
    trainer = L.Trainer(logger=False, accelerator="cpu", max_steps=3, callbacks=[bar], enable_checkpointing=False)
    trainer.fit_loop.max_epochs = -1  # as fit sets it when only max_steps is given
    bar._trainer = trainer  # as the bar's setup hook does
    assert "/-2" in bar._get_train_description(0)
    summary.replace_default_progress_bar(trainer.callbacks)
    assert isinstance(bar, summary.StepProgressBar) and bar._get_train_description(0).strip() == "Epoch 0"
    bounded = summary.StepProgressBar()
    bounded._trainer = L.Trainer(logger=False, accelerator="cpu", max_epochs=3, enable_checkpointing=False)
    assert bounded._get_train_description(1).strip() == "Epoch 1/2"  # an epoch-bounded run keeps Lightning's text

