"""Generation-time linears (``qerl.rollout.fast_linears``): q/k/v and gate/up as one linear over
shared storage, with the adapters' A concatenated and B block-diagonal, give the logits of the
separate peft linears; what cannot be fused is left alone. The training-time variant
(``fused_base_projections``: the NVFP4 bases only, with autograd) gives the same logits and LoRA
gradients in fewer NVFP4 launches."""

from __future__ import annotations

import pytest
import torch

from qerl.model import LoraSettings, enable_activation_checkpointing, load_policy
from qerl.nvfp4 import NVFP4WeightTensor
import qerl.nvfp4 as nvfp4
from qerl.rollout.fast_linears import fused_base_projections, fused_projections, lean_lora_forward, lora_state

LAYERS = 2          # tiny-qwen2
IDS = torch.tensor([[5, 6, 7, 8, 9, 11, 12, 13]])


def _policy(quantization: str, targets: list[str] | None = None):
    lora = LoraSettings(rank=4) if targets is None else LoraSettings(rank=4, target_modules=targets)
    model, _ = load_policy("tiny-qwen2", quantization, lora, dtype="fp32", device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:                      # a non-zero adapter (peft starts B at 0)
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return model.eval()


def _attention(model):
    return model.base_model.model.model.layers[0].self_attn


def _buffers(model) -> list[int]:
    """Where each q/k/v weight's data starts (packed codes for NVFP4)."""
    out = []
    for m in (_attention(model).q_proj, _attention(model).k_proj, _attention(model).v_proj):
        w = m.base_layer.weight
        out.append((w.qdata if isinstance(w, NVFP4WeightTensor) else w).data_ptr())
    return out


@pytest.mark.parametrize("quantization", ["nvfp4", "bf16"])
def test_fused_projections_equal_the_separate_linears(quantization):
    model = _policy(quantization)
    with torch.no_grad():
        ref = model(input_ids=IDS).logits
        with model.disable_adapter():
            base = model(input_ids=IDS).logits
        with fused_projections(model, torch.float32) as n:
            assert n == 2 * LAYERS
            assert all("forward" in vars(m) for m in (_attention(model).q_proj, _attention(model).k_proj))
            got = model(input_ids=IDS).logits
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()
        assert "forward" not in vars(_attention(model).q_proj)
        # the members' weights are now row blocks of one buffer: same values, so the same logits
        starts = _buffers(model)
        att = _attention(model)
        rows = [att.q_proj.base_layer.out_features, att.k_proj.base_layer.out_features]
        row_bytes = (att.q_proj.base_layer.in_features // 2 if quantization == "nvfp4"
                     else att.q_proj.base_layer.in_features * 4)
        assert starts[1] - starts[0] == rows[0] * row_bytes and starts[2] - starts[1] == rows[1] * row_bytes
        assert torch.equal(model(input_ids=IDS).logits, ref)
        with fused_projections(model, torch.float32) as n:       # found in place: nothing re-made
            assert n == 2 * LAYERS and _buffers(model) == starts
        with model.disable_adapter(), fused_projections(model, torch.float32) as n:
            assert n == 2 * LAYERS                               # base only, no LoRA GEMMs
            assert torch.allclose(model(input_ids=IDS).logits, base, atol=1e-5, rtol=1e-5)
        with fused_projections(model, torch.bfloat16):           # adapters in bf16, as generation runs them
            delta = model(input_ids=IDS).logits - base
        assert ((delta - (ref - base)).norm() / (ref - base).norm()) < 0.05
        # with the lean forward inside: the groups keep theirs, o/down get the lean one
        with fused_projections(model, torch.float32) as n, lean_lora_forward(model, torch.float32) as lean:
            assert n == 2 * LAYERS and lean == 2 * LAYERS          # o_proj and down_proj per layer
            assert torch.allclose(model(input_ids=IDS).logits, ref, atol=1e-5, rtol=1e-5)


def test_groups_with_an_adapter_on_some_members():
    """Adapters on q and v only (k plain, gate/up plain): k's rows of B stay zero."""
    model = _policy("nvfp4", targets=["q_proj", "v_proj"])
    with torch.no_grad():
        ref = model(input_ids=IDS).logits
        with fused_projections(model, torch.float32) as n:
            assert n == 2 * LAYERS
            got = model(input_ids=IDS).logits
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()


def test_what_is_not_fused():
    model = _policy("nvfp4")
    with torch.no_grad(), fused_projections(model, None) as n:   # adapters left to peft (fp32 "stored")
        assert n == 0
    model.train()
    with torch.no_grad(), fused_projections(model, torch.float32) as n:
        assert n == 0                                              # training: peft's forward, dropout...
    assert lora_state(_attention(model).q_proj)[0] == "other"
    model.eval()
    att = _attention(model)
    att.k_proj.base_layer.weight.per_tensor_scale = att.k_proj.base_layer.weight.per_tensor_scale * 2
    with torch.no_grad(), fused_projections(model, torch.float32) as n:
        assert n == 2 * LAYERS - 1                                 # that layer's q/k/v: scales differ


def test_a_member_called_on_another_input_computes_its_own_rows():
    model = _policy("bf16")
    att = _attention(model)
    g = torch.Generator().manual_seed(0)
    x1, x2 = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    with torch.no_grad():
        want = att.q_proj(x1), att.k_proj(x2), att.v_proj(x2), att.k_proj(x2)
        with fused_projections(model, torch.float32):
            got = att.q_proj(x1), att.k_proj(x2), att.v_proj(x2), att.k_proj(x2)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_nf4_groups_are_left_alone():
    pytest.importorskip("bitsandbytes")
    model = _policy("nf4")
    with torch.no_grad(), fused_projections(model, torch.float32) as n:
        assert n == 0


def test_export_after_the_weights_became_views(tmp_path):
    """After generation fused the storage, q/k/v's codes are row views of one buffer: the NVFP4
    export still writes each linear's own rows."""
    import os

    from safetensors.torch import load_file

    from qerl.export import export_nvfp4
    model, tok = load_policy("tiny-qwen2", "nvfp4", LoraSettings(rank=4), dtype="fp32", device="cpu")
    with torch.no_grad(), fused_projections(model.eval(), torch.float32) as n:
        assert n == 2 * LAYERS
    export_nvfp4(model, tok, tmp_path)
    written = load_file(os.path.join(tmp_path, "model.safetensors"))
    att = _attention(model)
    for name in ("q_proj", "k_proj", "v_proj"):
        w = getattr(att, name).base_layer.weight
        key = f"model.layers.0.self_attn.{name}.weight_packed"
        assert torch.equal(written[key], w.qdata)
        assert torch.equal(written[key.replace("packed", "scale")].view(torch.uint8), w.scale.view(torch.uint8))


@pytest.mark.parametrize("quantization", ["nvfp4", "bf16"])
def test_first_fusion_under_inference_mode_leaves_a_trainable_model(quantization):
    """``trainer.validate`` runs under ``torch.inference_mode`` (validation inside fit under no_grad):
    when it makes the first generation and ``trainer.fit`` of the same module follows in the process,
    the shared buffer must still be a normal tensor."""
    model = _policy(quantization)
    with torch.inference_mode(), fused_projections(model, torch.float32) as n:
        assert n == 2 * LAYERS
        model(input_ids=IDS)
    w = _attention(model).q_proj.base_layer.weight
    assert not (w.qdata if isinstance(w, NVFP4WeightTensor) else w).is_inference()
    model.train()
    model(input_ids=IDS).logits.float().pow(2).mean().backward()  # raised before the fix
    assert all(p.grad is not None for n_, p in model.named_parameters() if p.requires_grad)


def _loss_and_grads(model, block, checkpointing: bool = False, ids: torch.Tensor = IDS):
    """Logits, LoRA gradients and the number of NVFP4 linear launches of one forward + backward."""
    launches = []
    apply = nvfp4.NVFP4Linear.apply
    model.train()
    if checkpointing:
        enable_activation_checkpointing(model)
    model.zero_grad(set_to_none=True)
    try:
        nvfp4.NVFP4Linear.apply = lambda *a: launches.append(1) or apply(*a)
        with block:
            logits = model(input_ids=ids).logits                    # (1, T, V)
            logits.float().pow(2).mean().backward()
    finally:
        nvfp4.NVFP4Linear.apply = apply
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, len(launches)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fused_base_projections_train_like_the_separate_linears(checkpointing):
    """Same logits and LoRA gradients, 4 NVFP4 launches per layer and forward instead of 7 (the
    checkpoint recompute is a second forward), and the members' own forwards back afterwards."""
    import contextlib

    model = _policy("nvfp4")
    want, want_grads, separate = _loss_and_grads(model, contextlib.nullcontext(), checkpointing)
    with fused_base_projections(model) as n:
        assert n == 2 * LAYERS
        got, got_grads, fused = _loss_and_grads(model, contextlib.nullcontext(), checkpointing)
    passes = 2 if checkpointing else 1
    assert (separate, fused) == (7 * LAYERS * passes, 4 * LAYERS * passes)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert set(got_grads) == set(want_grads) and len(want_grads) == 2 * 7 * LAYERS   # every A and B
    for name, g in want_grads.items():
        assert torch.allclose(got_grads[name], g, atol=1e-6, rtol=1e-4), name
    assert not any("forward" in vars(m) for m in model.modules())
    _, _, after = _loss_and_grads(model, contextlib.nullcontext(), checkpointing)
    assert after == separate


def test_fused_base_projections_leave_16_bit_bases_alone():
    """bf16 bases are not fused in training (measured slower on the H200: see the docstring)."""
    model = _policy("bf16")
    with fused_base_projections(model) as n:
        assert n == 0
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [8, 300])
def test_fused_base_projections_on_cuda(tokens):
    """The same through the CUDA kernels (bf16 activations; 8 tokens: the decode kernels, 300: the
    training path), against the separate linears on the same GPU."""
    import contextlib

    lora = LoraSettings(rank=4)
    model, _ = load_policy("tiny-qwen2", "nvfp4", lora, dtype="bf16", device="cuda")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    ids = torch.randint(1, 100, (1, tokens), generator=torch.Generator().manual_seed(0)).cuda()
    want, want_grads, _ = _loss_and_grads(model, contextlib.nullcontext(), ids=ids)
    got, got_grads, _ = _loss_and_grads(model, fused_base_projections(model), ids=ids)
    assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()
    for name, g in want_grads.items():
        err = (got_grads[name] - g).norm() / g.norm().clamp_min(1e-12)
        assert err < 2e-2, (name, float(err))
