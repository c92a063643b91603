"""The fused kernels (``qerl.fused_ops``): RMSNorm with AQN noise, rotary embedding, SiLU-mul,
forward and backward. CPU: through Triton's interpreter (fp32, in a subprocess: the interpreter is
chosen when Triton is imported), kernels and their gradients against transformers' ops and autograd,
a generation with and without them, and a training forward + backward (gradient checkpointing, AQN
on) with and without them. GPU: bf16 against the eager ops, the engine's output and a QeRLModule
training step with and without them."""

import importlib.util
import os
import textwrap

import pytest
import torch

import triton_interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = torch.cuda.is_available()

_COMMON = textwrap.dedent("""
    import torch
    from transformers.models.qwen2 import modeling_qwen2 as M
    from qerl.fused_ops import rms_norm, rotary, silu_mul

    def check_kernels(device, dtype, exact):
        g = torch.Generator().manual_seed(0)
        rnd = lambda *s: torch.randn(*s, generator=g).to(device, dtype)
        # rotary: q as the attention makes it, (B, T, H, D) viewed as (B, H, T, D); cos / sin (B, T, D)
        q, k = rnd(3, 5, 4, 16).transpose(1, 2), rnd(3, 5, 2, 16).transpose(1, 2)
        cos, sin = rnd(3, 5, 16), rnd(3, 5, 16)
        ref_q, ref_k = M.apply_rotary_pos_emb(q, k, cos, sin)
        assert torch.equal(rotary(q, cos, sin), ref_q) and torch.equal(rotary(k, cos, sin), ref_k)
        assert torch.equal(rotary(q, cos[:1], sin[:1]), M.apply_rotary_pos_emb(q, k, cos[:1], sin[:1])[0])
        # RMSNorm, plain (weight in the model dtype) and noisy (fp32 scale); D not a power of two
        norm = M.Qwen2RMSNorm(48, eps=1e-6).to(device, dtype)
        with torch.no_grad():
            norm.weight.copy_(rnd(48))
        x = rnd(7, 48) * 3
        out = rms_norm(x, norm.weight, 1e-6, dtype)
        with torch.no_grad():
            ref = norm(x)
        h = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).float()
        noise = torch.randn(48, generator=g).to(device) * 0.01
        noisy, noisy_ref = rms_norm(x, norm.weight.float() + noise, 1e-6, dtype), (h * (norm.weight.float() + noise)).to(dtype)
        # SiLU(gate) * up
        gate, up = rnd(6, 40), rnd(6, 40)
        act = silu_mul(gate, up)
        act_ref = torch.nn.functional.silu(gate) * up
        gate_up = rnd(2, 3, 80)                       # the two halves of one fused gate_up output
        act_halves = silu_mul(gate_up[..., :40], gate_up[..., 40:])
        halves_ref = torch.nn.functional.silu(gate_up[..., :40]) * gate_up[..., 40:]
        assert act_halves.shape == (2, 3, 40) and act_halves.is_contiguous()
        tol = dict(atol=1e-6, rtol=1e-5) if exact else dict(atol=0, rtol=2 ** -7)   # bf16: 1 ulp
        for a, b in ((out, ref), (noisy, noisy_ref), (act, act_ref), (act_halves, halves_ref)):
            assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), **tol), (a - b).abs().max()
        check_gradients(rnd, norm, noise, exact)

    def grads(fn, *inputs):
        # d(sum(fn(*inputs) * w)) / d inputs for a fixed random w (a non-uniform upstream gradient)
        inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
        out = fn(*inputs)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
        (out * w).sum().backward()
        return [t.grad for t in inputs]

    def check_gradients(rnd, norm, noise, exact):
        from qerl.noisy_norms import _rmsnorm
        q, cos, sin = rnd(2, 5, 3, 16).transpose(1, 2), rnd(2, 5, 16), rnd(2, 5, 16)   # (B, H, T, D) view
        for c, s in ((cos, sin), (cos[:1], sin[:1])):   # the rotary backward rounds as autograd does: equal
            got, want = grads(lambda t: rotary(t, c, s), q), grads(lambda t: M.apply_rotary_pos_emb(t, t, c, s)[0], q)
            assert torch.equal(got[0], want[0]), (got[0] - want[0]).abs().max()
        g, u = rnd(6, 40), rnd(6, 40)
        pairs = [(grads(silu_mul, g, u), grads(lambda a, b: torch.nn.functional.silu(a) * b, g, u))]
        x = rnd(7, 48) * 3
        for z in (None, noise):                      # the plain norm (HF's forward) and the noisy one (AQN's)
            ref = (lambda t: norm(t)) if z is None else (lambda t: _rmsnorm(norm, t, z, 1e-6))
            pairs.append((grads(lambda t: rms_norm(t, norm.weight, 1e-6, x.dtype, z), x), grads(ref, x)))
        # bf16: the norm's reduction runs in one fp32 pass where autograd rounds between its ops
        tol = dict(atol=1e-5, rtol=1e-4) if exact else dict(atol=2e-2, rtol=2 ** -6)
        for i, (got, want) in enumerate(pairs):
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype)
                assert torch.allclose(a.float(), b.float(), **tol), (i, (a.float() - b.float()).abs().max())
""")

_INTERP_SCRIPT = _COMMON + textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from qerl.aqn import attach_noisy_norms
    from qerl.model import LoraSettings, enable_activation_checkpointing, load_policy
    from qerl.noisy_norms import _NoisyForward
    from qerl.rollout import SamplingSettings
    from qerl.fused_ops import fused_ops
    from qerl.rollout.fast_linears import fused_projections
    from qerl.rollout.hf import HFEngine

    check_kernels("cpu", torch.float32, exact=True)
    model, tok = load_policy("tiny-qwen2", "nvfp4", LoraSettings(rank=4), dtype="fp32", device="cpu")
    norms = attach_noisy_norms(model)
    norms.set_noise(0.05, seed=0, step=1)               # AQN on: the fused norms carry the noise
    model.eval()
    engine = HFEngine(stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    engine.sync(model)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [20]]
    original_rotary = M.apply_rotary_pos_emb
    for sampling in (SamplingSettings(temperature=0.0, max_new_tokens=6), SamplingSettings(temperature=1.0, max_new_tokens=6)):
        runs = []
        for fused in (False, True, "with fused projections"):   # the last: the MLP gets gate/up halves
            ctx = fused_ops(model) if fused else __import__("contextlib").nullcontext((0, 0, False))
            groups = fused_projections(model, torch.float32) if fused == "with fused projections" else __import__("contextlib").nullcontext(0)
            with torch.no_grad(), groups as n_groups, ctx as patched:
                row_keys = [(1, i) for i in range(len(prompts))]  # (prompt seed, sample) per row
                runs.append(engine._generate_chunk(prompts, sampling, row_keys, static=True))
                if fused:
                    assert patched == (5, 2, True), patched          # 2 layers x 2 norms + final, 2 MLPs
                    assert M.apply_rotary_pos_emb is not original_rotary
                assert n_groups == (4 if fused == "with fused projections" else 0)
        plain = runs[0]
        for fused in runs[1:]:
            assert plain.completion_ids == fused.completion_ids, (plain.completion_ids, fused.completion_ids)
            for a, b in zip(plain.sampler_logprobs, fused.sampler_logprobs):
                assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5), (a, b)
    assert M.apply_rotary_pos_emb is original_rotary
    layer = model.base_model.model.model.layers[0]
    assert isinstance(layer.input_layernorm.forward, _NoisyForward)      # AQN's wrapper is back
    assert "forward" not in vars(layer.mlp) and not hasattr(layer.input_layernorm, "_qerl_eps")

    # training: forward + backward with gradient checkpointing (the recompute runs inside the block)
    # and AQN on; every LoRA gradient as with transformers' eager ops
    model.train()
    enable_activation_checkpointing(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))    # B = 0 would zero A's gradient
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])

    def lora_grads(fused):
        model.zero_grad(set_to_none=True)
        with (fused_ops(model) if fused else __import__("contextlib").nullcontext((0, 0, False))) as patched:
            if fused:
                with fused_ops(model) as nested:                               # a block inside a block: no-op
                    assert nested == (0, 0, False)
                with fused_ops(model.base_model.model) as inner:               # ... also on a model it holds
                    assert inner[:2] == (0, 0), inner
            logits = model(input_ids=ids).logits
            (logits.float().log_softmax(-1)[..., :7] * torch.arange(7.0)).sum().backward()
        return patched, {{n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}}
    _, eager = lora_grads(False)
    patched, fused = lora_grads(True)
    assert patched == (5, 2, True) and len(eager) == 2 * 2 * 7, (patched, len(eager))
    for name, g in eager.items():
        scale = g.abs().max()                                                  # fp32: ~1e-6 relative seen
        assert scale > 0 and (fused[name] - g).abs().max() <= 1e-4 * scale, (name, (fused[name] - g).abs().max(), scale)
    print("FUSED_OK")
""")


@pytest.mark.skipif(not triton_interpreter.ready(), reason=triton_interpreter.REASON)
def test_fused_ops_in_triton_interpreter():
    triton_interpreter.run(_INTERP_SCRIPT.format(root=ROOT), "FUSED_OK")


def test_fused_ops_are_off_on_cpu_without_the_interpreter():
    from qerl.rollout.hf import HFEngine
    assert HFEngine(stop_token_ids=[0], pad_token_id=0).fused_ops is True      # the default; CUDA only
    if importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") != "1":
        from qerl.fused_ops import fused_ops
        with fused_ops(torch.nn.Linear(2, 2)) as patched:
            assert patched == (0, 0, False)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_fused_rotary_passes_what_it_does_not_handle_to_the_original():
    from qerl.fused_ops import _fused_rotary
    calls = []
    wrapped = _fused_rotary(lambda *a, **kw: calls.append((len(a), kw)) or "original")
    q, cos = torch.zeros(1, 2, 3, 4), torch.zeros(1, 3, 4)
    assert wrapped(q, q, cos, cos, None, unsqueeze_dim=1) == "original"       # an older signature
    assert wrapped(q, q, cos, cos, unsqueeze_dim=2) == "original"
    assert wrapped(q, q, cos[:, :, :2], cos[:, :, :2]) == "original"          # partial rotary
    assert calls == [(5, {"unsqueeze_dim": 1}), (4, {"unsqueeze_dim": 2}), (4, {})]


def test_interleaved_rotary_models_keep_their_own_rotation(monkeypatch):
    """Cohere, Helium and ERNIE 4.5 rotate interleaved pairs with the same call signature: the
    half-split kernel would silently scramble their attention, so their modules are not patched."""
    import importlib

    from qerl.fused_ops import _is_half_split_rotary, fused_ops

    half_split = {name: _is_half_split_rotary(importlib.import_module(f"transformers.models.{name}.modeling_{name}"))
                  for name in ("qwen2", "qwen3", "llama", "mistral", "cohere", "helium", "ernie4_5")}
    assert half_split == {"qwen2": True, "qwen3": True, "llama": True, "mistral": True,
                          "cohere": False, "helium": False, "ernie4_5": False}
    from transformers import CohereConfig, CohereForCausalLM
    import transformers.models.cohere.modeling_cohere as cohere

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = CohereForCausalLM(CohereConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1))
    original = cohere.apply_rotary_pos_emb
    with fused_ops(model) as (_, _, rotary_patched):
        assert not rotary_patched and cohere.apply_rotary_pos_emb is original


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_fused_kernels_bf16():
    scope = {}
    exec(_COMMON, scope)
    scope["check_kernels"]("cuda", torch.bfloat16, exact=False)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gpu_hf_rms_norms_pass_the_bit_exact_check(arch):
    """AQN and the fused norm take a norm only when its forward equals the plain RMSNorm formula bit
    for bit: transformers' Qwen2 / Llama norms on CUDA in bf16 (trained scales, not ones) must pass."""
    from qerl.noisy_norms import rms_norm_mismatch
    from qerl.tiny import build_tiny_model

    model = build_tiny_model(arch).to("cuda", torch.bfloat16)
    norms = [m for n, m in model.named_modules() if n.endswith("layernorm") or n.endswith("model.norm")]
    with torch.no_grad():
        for m in norms:
            m.weight.uniform_(0.5, 1.5)
    assert norms and all(rms_norm_mismatch(m) is None for m in norms)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_engine_with_and_without_fused_ops():
    """bf16 NVFP4 policy with AQN on the GPU, CUDA-graph decoding: the engine with the fused ops (and
    also with the fused projections) samples what the unfused one samples (greedy tokens equal,
    sampled log-probs within bf16 rounding)."""
    from qerl.aqn import attach_noisy_norms
    from qerl.model import LoraSettings, load_policy
    from qerl.rollout import SamplingSettings
    from qerl.rollout.hf import HFEngine

    model, tok = load_policy("tiny-qwen2", "nvfp4", LoraSettings(rank=4), dtype="bf16", device="cuda")
    attach_noisy_norms(model).set_noise(0.05, seed=0, step=1)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15], [20]]
    for sampling in (SamplingSettings(temperature=0.0, max_new_tokens=16), SamplingSettings(temperature=1.0, max_new_tokens=16)):
        outs = []
        for fused, projections in ((False, False), (True, False), (True, True)):
            engine = HFEngine(stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, fused_ops=fused,
                              fused_projections=projections)
            engine.sync(model)
            outs.append(engine.generate(prompts, 2, sampling, seed=3))
        plain = outs[0]
        for fused in outs[1:]:
            same = sum(a == b for a, b in zip(plain.completion_ids, fused.completion_ids))
            assert same >= len(plain.completion_ids) - 1, (plain.completion_ids, fused.completion_ids)
            for a, b, ca, cb in zip(plain.sampler_logprobs, fused.sampler_logprobs, plain.completion_ids, fused.completion_ids):
                if ca == cb:
                    assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=0.05), (a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_training_gradients_with_and_without_fused_ops():
    """bf16 NVFP4 policy with AQN and gradient checkpointing on the GPU: a forward + backward inside
    ``fused_ops`` gives the LoRA gradients of transformers' eager ops (on the H200 bit-identical in
    a fresh process, 5e-3 relative after the quickstart tests had run in it: other kernel choices;
    asserted within 2e-2), and the patched forwards are gone afterwards."""
    import contextlib

    from qerl.aqn import attach_noisy_norms
    from qerl.fused_ops import fused_ops
    from qerl.model import LoraSettings, enable_activation_checkpointing, load_policy

    model, _ = load_policy("tiny-qwen2", "nvfp4", LoraSettings(rank=8), dtype="bf16", device="cuda")
    attach_noisy_norms(model).set_noise(0.05, seed=0, step=1)
    model.train()
    enable_activation_checkpointing(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator("cuda").manual_seed(2))
    ids = torch.randint(1, 100, (4, 40), generator=torch.Generator().manual_seed(3)).cuda()

    def lora_grads(fused):
        model.zero_grad(set_to_none=True)
        with fused_ops(model) if fused else contextlib.nullcontext((0, 0, False)) as patched:
            logits = model(input_ids=ids).logits
            logits.float().log_softmax(-1).gather(-1, ids[..., None]).mean().backward()
        return patched, {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}
    _, eager = lora_grads(False)
    patched, fused = lora_grads(True)
    assert patched[0] > 0 and patched[1] > 0 and patched[2]
    for name, g in eager.items():
        rel = ((fused[name] - g).norm() / g.norm()).item()
        assert rel < 2e-2, (name, rel)
    assert "forward" not in vars(model.base_model.model.model.layers[0].mlp)
