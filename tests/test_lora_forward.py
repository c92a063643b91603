"""LoRA in the activations' dtype (``qerl.lora_forward``, ``LoraSettings.compute_dtype: model``): on a
bf16 model it trains the same fp32 adapter as peft's fp32 forward up to bf16 rounding, computes
exactly what the embedded engine computes while generating, and leaves fp32 models, disabled
adapters and peft's other cases to peft."""

from __future__ import annotations

import copy
import importlib.util
import io

import pytest
import torch

from qerl.lora_forward import is_swapped
from qerl.model import LoraSettings, load_policy
from qerl.rollout.fast_linears import lean_lora_forward

IDS = torch.tensor([[5, 6, 7, 8, 9, 11, 12, 13], [21, 22, 23, 24, 25, 26, 27, 28]])   # (B, T)


def _policy(quantization: str, compute_dtype: str, dtype: str = "bf16", dropout: float = 0.0):
    lora = LoraSettings(rank=4, alpha=8, dropout=dropout, compute_dtype=compute_dtype)
    model, _ = load_policy("tiny-qwen2", quantization, lora, dtype=dtype, device="cpu")
    with torch.no_grad():        # the same non-zero adapter in every build (peft starts B at 0, A at random)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(sum(map(ord, name)))))
    return model


def _q_proj(model):
    return model.base_model.model.model.layers[0].self_attn.q_proj


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _loss_and_grads(model):
    model.train()
    logits = model(input_ids=IDS).logits                                      # (B, T, V)
    logits.float().log_softmax(-1)[..., 0].mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize("quantization", ["nvfp4", "bf16"])
def test_bf16_model_trains_the_fp32_adapter_like_peft(quantization):
    ours, peft = _policy(quantization, "model"), _policy(quantization, "stored")
    assert is_swapped(_q_proj(ours)) and not is_swapped(_q_proj(peft))
    assert isinstance(_q_proj(ours), type(_q_proj(peft)))                   # still peft's class underneath
    assert list(ours.state_dict()) == list(peft.state_dict())                # same names in checkpoints
    logits, grads = _loss_and_grads(ours)
    ref_logits, ref_grads = _loss_and_grads(peft)
    assert logits.dtype == torch.bfloat16
    # bf16 rounding of x A^T and of the cast weights: measured 0.9% on logits, <= 2.2% per gradient
    # tensor (tiny-qwen2, |B| = 0.05, far larger than an adapter after a few RL steps)
    assert _rel(logits, ref_logits) < 0.03
    assert set(grads) == set(ref_grads) and grads and all("lora_" in n for n in grads)
    for name, g in grads.items():
        assert g.dtype == torch.float32, name                                 # fp32 master weights
        assert _rel(g, ref_grads[name]) < 0.06, name


def test_trainer_forward_is_the_engines_generation_forward():
    """In train mode (dropout 0) the logits equal, bit for bit, those of the embedded engine's
    generation-time LoRA on bf16 copies (``hf_adapter_dtype: model``): trainer and sampler agree."""
    model = _policy("nvfp4", "model")
    with torch.no_grad():
        trained = model.train()(input_ids=IDS).logits
        model.eval()
        with lean_lora_forward(model, torch.bfloat16) as n:
            assert n == 7 * 2
            sampled = model(input_ids=IDS).logits
    assert torch.equal(trained, sampled)
    assert is_swapped(_q_proj(model)) and "forward" not in vars(_q_proj(model))   # the context undid only itself


def test_fp32_model_and_disabled_adapter_run_peft():
    ours, peft = _policy("nvfp4", "model", dtype="fp32"), _policy("nvfp4", "stored", dtype="fp32")
    with torch.no_grad():
        assert torch.equal(ours(input_ids=IDS).logits, peft(input_ids=IDS).logits)
    ours, peft = _policy("nvfp4", "model"), _policy("nvfp4", "stored")
    with torch.no_grad(), ours.disable_adapter(), peft.disable_adapter():    # the KL reference pass
        assert torch.equal(ours(input_ids=IDS).logits, peft(input_ids=IDS).logits)


def test_dropout_applies_to_the_adapter_input_in_training_only():
    model = _policy("bf16", "model", dropout=0.5)
    q = _q_proj(model)
    x = torch.randn(4, q.in_features, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        q.eval()
        eval_a, eval_b = q(x), q(x)
        q.train()
        train_a, train_b = q(x), q(x)
    assert torch.equal(eval_a, eval_b) and not torch.equal(train_a, train_b)
    assert not torch.equal(train_a, eval_a)
    with torch.no_grad():                              # the base linear sees the undropped input
        q.lora_B["default"].weight.zero_()
        assert torch.equal(q(x), q.base_layer(x))


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="nf4 needs bitsandbytes")
def test_nf4_base_layer_runs_under_the_bf16_adapter():
    ours, peft = _policy("nf4", "model"), _policy("nf4", "stored")
    assert is_swapped(_q_proj(ours))
    logits, grads = _loss_and_grads(ours)
    ref_logits, ref_grads = _loss_and_grads(peft)
    assert _rel(logits, ref_logits) < 0.03 and set(grads) == set(ref_grads)


def test_swapped_model_pickles_and_deep_copies():
    """``torch.save(model)`` (and spawned workers) pickle the generated classes by their peft base."""
    model = _policy("nvfp4", "model")
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for twin in (torch.load(buf, weights_only=False), copy.deepcopy(model)):
        assert is_swapped(_q_proj(twin)) and type(_q_proj(twin)) is type(_q_proj(model))
        with torch.no_grad():
            assert torch.equal(twin(input_ids=IDS).logits, model(input_ids=IDS).logits)


def test_a_further_subclass_still_reaches_peft():
    """FSDP2 and parametrizations subclass a module's class again: the fallbacks must still reach
    peft's forward (not recurse) and pickling must still name peft's class."""
    model = _policy("nvfp4", "model")
    q = _q_proj(model)
    q.__class__ = type("Wrapped" + type(q).__name__, (type(q),), {})
    x = torch.randn(3, q.in_features, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(q(x), _q_proj(_policy("nvfp4", "model"))(x))          # the bf16 path
        with model.disable_adapter():
            assert torch.equal(q(x), q.base_layer(x))                            # peft's, no recursion
    assert is_swapped(q) and is_swapped(copy.deepcopy(q))


def test_older_checkpoints_count_as_fp32_lora_and_rollout_order():
    """A checkpoint written before ``compute_dtype`` / ``group_by_length`` existed ran peft's fp32 LoRA
    in rollout-order micro-batches: resuming it with the new defaults is warned like any change."""
    from lightning_modules.checkpointing import _with_older_defaults
    from lightning_modules.settings import hparam_differences

    config = {"lora": {"rank": 8, "compute_dtype": "model"}, "loss": {"kl_coef": 0.0, "group_by_length": True}}
    old = {"lora": {"rank": 8}, "loss": {"kl_coef": 0.0}}
    assert hparam_differences(config, _with_older_defaults(old)) == [
        "model.lora.compute_dtype: 'model' (config) vs 'stored' (checkpoint)",
        "model.loss.group_by_length: True (config) vs False (checkpoint)"]
    assert hparam_differences(config, _with_older_defaults({"lora": {"rank": 8, "compute_dtype": "model"},
                                                            "loss": {"kl_coef": 0.0, "group_by_length": True}})) == []
    # a config without those sections saved None there: its defaults ran, the older ones
    assert len(hparam_differences(config, _with_older_defaults({"lora": None, "loss": None}))) == 2


def test_unknown_compute_dtype_is_refused():
    with pytest.raises(ValueError, match="compute_dtype must be 'model' or 'stored'"):
        LoraSettings(compute_dtype="fp16")
