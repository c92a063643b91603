"""The embedded (hf) engine: sampler log-probs equal the trainer's forward, and the static-cache
decoder (CUDA-graph replayed on GPU) generates exactly what the dynamic-cache one does."""

from __future__ import annotations

import math
import pytest
import torch

from qerl.aqn import attach_noisy_norms
from qerl.model import LoraSettings, load_policy
from qerl.rollout import SamplingSettings
from qerl.rollout.base import prompt_seeds, sample_inverse_cdf, sample_uniforms
from qerl.rollout.hf import (HFEngine, _packed_gqa_sdpa, decode_mode, filter_logits, lean_lora_forward,
                             packed_gqa_decode_attention)

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15], [20]]  # different lengths: left padding matters


def _policy(attn: str = "sdpa", device: str = "cpu", dtype: str = "fp32", quantization: str = "nvfp4",
            lora_compute: str = "model"):
    model, tok = load_policy("tiny-qwen2", quantization, LoraSettings(rank=4, compute_dtype=lora_compute),
                             dtype=dtype, device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    model.config._attn_implementation = attn
    norms = attach_noisy_norms(model)
    norms.set_noise(0.05, seed=0, step=1)  # AQN on: the generating forward carries the noise
    return model.eval(), tok


def _generate(engine, model, sampling, seed, static):
    engine.sync(model)
    row_keys = [(s, 0) for s in prompt_seeds(seed, len(PROMPTS))]
    with torch.no_grad():
        return engine._generate_chunk(PROMPTS, sampling, row_keys, static=static)


def _teacher_forced(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0].cpu()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_static_decoder_equals_dynamic_and_the_trainer(attn):
    model, tok = _policy(attn)
    engine = HFEngine(stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, max_batch_size=8)
    for sampling in (SamplingSettings(temperature=0.0, max_new_tokens=12),
                     SamplingSettings(temperature=1.0, max_new_tokens=12),
                     SamplingSettings(temperature=0.7, max_new_tokens=12)):
        dyn = _generate(engine, model, sampling, 3, static=False)
        sta = _generate(engine, model, sampling, 3, static=True)
        assert sta.completion_ids == dyn.completion_ids and sta.finish_reasons == dyn.finish_reasons
        assert all(len(c) >= 1 for c in dyn.completion_ids)
        for a, b in zip(sta.sampler_logprobs, dyn.sampler_logprobs):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
        # the sampler's log-probs are the trainer's log softmax(logits / T) of the same tokens
        T = sampling.temperature if sampling.temperature > 0 else 1.0
        for i, (c, lp) in enumerate(zip(dyn.completion_ids, dyn.sampler_logprobs)):
            ref = _teacher_forced(model, PROMPTS[i], c, T)
            assert torch.allclose(ref, torch.tensor(lp), atol=1e-4), (i, ref, lp)


@pytest.mark.parametrize("static", [False, True])
def test_rows_stop_where_they_stop_whatever_the_stop_check_interval(static, monkeypatch):
    """The host reads "all rows stopped?" only every STOP_CHECK_EVERY tokens: rows that stop early
    decode padding meanwhile, which must not reach the output (same tokens, log-probs, reasons)."""
    import qerl.rollout.hf as hf
    model, tok = _policy()
    free = _generate(HFEngine([-1], tok.pad_token_id), model, SamplingSettings(temperature=0.0, max_new_tokens=12), 0, static)
    stop = free.completion_ids[0][2]                # row 0 stops at its third token
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=12)
    outs = []
    for prompts in (PROMPTS, PROMPTS[:1]):          # the second: every row stops early
        for every in (1, 8, 5):
            monkeypatch.setattr(hf, "STOP_CHECK_EVERY", every)
            engine = HFEngine([stop], tok.pad_token_id)
            engine.sync(model)
            with torch.no_grad():
                outs.append(engine._generate_chunk(prompts, greedy, torch.Generator().manual_seed(0), static=static))
    first, alone = outs[0], outs[3]
    assert alone.completion_ids[0] == first.completion_ids[0] and alone.finish_reasons == ["stop"]
    for other in outs[4:]:
        assert other.completion_ids == alone.completion_ids and other.sampler_logprobs == alone.sampler_logprobs
    assert first.finish_reasons[0] == "stop" and first.completion_ids[0][-1] == stop and len(first.completion_ids[0]) <= 3
    for other in outs[1:3]:
        assert other.completion_ids == first.completion_ids and other.finish_reasons == first.finish_reasons
        assert other.sampler_logprobs == first.sampler_logprobs


def test_truncated_sampling_returns_the_log_probs_it_sampled_from():
    """top-k / top-p: the sampler log-prob is over the renormalised kept set (vLLM's
    processed_logprobs), so the trainer/sampler ratio carries the truncation."""
    model, tok = _policy()
    engine = HFEngine(stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, max_batch_size=8)
    top1 = _generate(engine, model, SamplingSettings(temperature=1.0, top_k=1, max_new_tokens=8), 0, static=False)
    greedy = _generate(engine, model, SamplingSettings(temperature=0.0, max_new_tokens=8), 0, static=False)
    assert top1.completion_ids == greedy.completion_ids  # top-1 sampling is greedy ...
    assert all(lp == 0.0 for row in top1.sampler_logprobs for lp in row)  # ... and sure of every token
    nucleus = _generate(engine, model, SamplingSettings(temperature=1.0, top_p=0.5, max_new_tokens=8), 1, static=False)
    for i, (c, lp) in enumerate(zip(nucleus.completion_ids, nucleus.sampler_logprobs)):
        full = _teacher_forced(model, PROMPTS[i], c, 1.0)
        kept = torch.tensor(lp)
        assert torch.all(kept >= full - 1e-5) and torch.all(kept <= 0)
        assert torch.any(kept > full + 1e-3)  # a real truncation happened somewhere
    # min-p 0.5: only tokens at least half as likely as the best one; the log-probs are over that set
    minp = _generate(engine, model, SamplingSettings(temperature=1.0, min_p=0.5, max_new_tokens=8), 2, static=False)
    for i, (c, lp) in enumerate(zip(minp.completion_ids, minp.sampler_logprobs)):
        full = _teacher_forced(model, PROMPTS[i], c, 1.0)
        assert torch.all(torch.tensor(lp) >= full - 1e-5)


def test_filter_logits_min_p_then_top_k_then_top_p():
    """vLLM's order: min-p on the tempered probabilities, then top-k, then top-p over what is left."""
    probs = torch.tensor([[0.40, 0.30, 0.15, 0.10, 0.05]])
    logits = probs.log()
    kept = lambda **kw: torch.isfinite(filter_logits(logits, kw.get("k", 0), kw.get("p", 1.0), kw.get("m", 0.0)))[0].tolist()
    assert kept(m=0.3) == [True, True, True, False, False]  # >= 0.3 x 0.40 = 0.12
    assert kept(m=0.3, k=2) == [True, True, False, False, False]
    # top-p over the renormalised min-p set (0.40 / 0.85 = 0.47 < 0.5, so the second token is kept too)
    assert kept(m=0.3, p=0.5) == [True, True, False, False, False]
    assert kept(m=0.0) == [True] * 5 and kept(m=1.0) == [True, False, False, False, False]


def test_adapters_run_in_the_model_dtype_while_generating():
    """peft keeps trainable adapters in fp32 on a bf16 model; the engine casts them to bf16 for the
    duration of generate (adapter_dtype='model') or leaves them ('stored'), and always hands the
    trainer back the same fp32 Parameters, bitwise. (A trainer with ``LoraSettings.compute_dtype:
    stored``: peft's fp32 forward; with the default ``model`` both engine settings compute alike.)"""
    model, tok = _policy(dtype="bf16", lora_compute="stored")
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert lora and {p.dtype for p in lora.values()} == {torch.float32}
    before = {n: (p, p.detach().clone()) for n, p in lora.items()}
    seen = []   # the dtype of the A matrix q_proj's adapter runs with (peft's module or the lean copy)
    q_proj = next(m for n, m in model.named_modules() if n.endswith("q_proj") and hasattr(m, "lora_A"))
    hook = q_proj.register_forward_pre_hook(lambda mod, args: seen.append(
        mod._qerl_lean[0].dtype if hasattr(mod, "_qerl_lean") else mod.lora_A["default"].weight.dtype)
        if not mod.disable_adapters else None)
    outs = {}
    try:
        for adapter_dtype, want in (("model", torch.bfloat16), ("stored", torch.float32)):
            seen.clear()
            engine = HFEngine([tok.eos_token_id], tok.pad_token_id, max_batch_size=8, adapter_dtype=adapter_dtype)
            engine.sync(model)
            outs[adapter_dtype] = engine.generate(PROMPTS, 1, SamplingSettings(temperature=0.0, max_new_tokens=6), seed=0)
            assert seen and set(seen) == {want}, (adapter_dtype, set(seen))
            for n, p in model.named_parameters():
                if n in before:
                    assert p is before[n][0] and p.dtype == torch.float32 and torch.equal(p, before[n][1])
        seen.clear()
        engine.sync(model, adapter=False)                   # reference policy: no adapter, nothing cast
        engine.generate(PROMPTS, 1, SamplingSettings(temperature=0.0, max_new_tokens=2), seed=0)
        assert not seen
    finally:
        hook.remove()
    # the same policy up to bf16 rounding of the adapter: the first greedy token's log-prob is close
    first = [(a[0], b[0]) for a, b in zip(outs["model"].sampler_logprobs, outs["stored"].sampler_logprobs)]
    assert all(abs(a - b) < 0.05 for a, b in first), first
    with pytest.raises(ValueError, match="adapter_dtype"):
        HFEngine([0], 0, adapter_dtype="fp16")


def test_trainer_arithmetic_lora_samples_alike_with_either_adapter_dtype():
    """With the trainer's LoRA in the model's dtype (``compute_dtype: model``, the default) the
    engine's cached bf16 copies and the model's own forward are the same arithmetic: the sampler's
    log-probs agree bitwise."""
    model, tok = _policy(dtype="bf16")
    outs = {}
    for adapter_dtype in ("model", "stored"):
        engine = HFEngine([tok.eos_token_id], tok.pad_token_id, max_batch_size=8, adapter_dtype=adapter_dtype)
        engine.sync(model)
        outs[adapter_dtype] = engine.generate(PROMPTS, 2, SamplingSettings(temperature=1.0, max_new_tokens=6), seed=0)
    assert outs["model"].completion_ids == outs["stored"].completion_ids
    assert outs["model"].sampler_logprobs == outs["stored"].sampler_logprobs


@pytest.mark.parametrize("quantization", ["nvfp4", "bf16", "nf4"])
def test_lean_lora_forward_matches_peft(quantization):
    """While generating, every adapted linear runs as two GEMMs with the scaling folded into B: the
    logits equal peft's (fp32, tolerance for the reassociated sum); modules are restored afterwards;
    a model in training mode or with the adapter disabled is left alone."""
    if quantization == "nf4":
        pytest.importorskip("bitsandbytes")       # peft's bnb LoRA class: same lean path
    model, tok = _policy(quantization=quantization)
    lora_linears = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    ids = torch.tensor([tok.encode("What is 3 + 4? Think step by step.")])
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        with lean_lora_forward(model, torch.float32) as n:
            assert n == len(lora_linears) > 0 and all("forward" in vars(m) for m in lora_linears)
            got = model(input_ids=ids).logits
        assert not any("forward" in vars(m) or hasattr(m, "_qerl_lean") for m in lora_linears)
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()
        assert torch.equal(model(input_ids=ids).logits, ref)                    # peft's forward again
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        with lean_lora_forward(model, torch.bfloat16) as n:                     # bf16 copies of the adapters
            assert n == len(lora_linears)
            delta = model(input_ids=ids).logits - base                          # the adapters' contribution
        assert ((delta - (ref - base)).norm() / (ref - base).norm()) < 0.05     # = peft's, to bf16 rounding
        with model.disable_adapter(), lean_lora_forward(model, torch.float32) as n:
            assert n == 0
        model.train()
        with lean_lora_forward(model, torch.float32) as n:
            assert n == 0


def test_generation_keeps_the_adapters_gradient_accumulators():
    """DDP all-reduces a gradient from a hook on the parameter's AccumulateGrad node; generating
    (adapters in the model's dtype) must leave those nodes, and the Parameters, as they were."""
    model, tok = _policy(dtype="bf16")
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    acc = [p.view_as(p).grad_fn.next_functions[0][0] for p in lora]
    fired = []
    for node in acc:
        node.register_hook(lambda grad_inputs, grad_outputs: fired.append(1))
    engine = HFEngine([tok.eos_token_id], tok.pad_token_id, max_batch_size=8, adapter_dtype="model")
    engine.sync(model)
    engine.generate(PROMPTS, 1, SamplingSettings(temperature=1.0, max_new_tokens=4), seed=0)
    assert all(p.view_as(p).grad_fn.next_functions[0][0] is node for p, node in zip(lora, acc))
    model.train()
    ids = torch.tensor([tok.encode("1 + 1 = 2")])
    model(input_ids=ids).logits.float().sum().backward()
    assert len(fired) == len(lora)


@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
def test_packed_gqa_attention_equals_repeated_kv(mask_kind):
    """One query token, 6 query heads on 2 K/V heads: the packed SDPA equals SDPA on K/V repeated per
    query head (what transformers does with a mask), with a boolean, an additive or no mask."""
    from types import SimpleNamespace
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, L, D = 3, 6, 2, 9, 8
    q, k, v = (torch.randn(B, h, t, D, generator=g) for h, t in ((H, 1), (Hkv, L), (Hkv, L)))
    allowed = torch.rand(B, 1, 1, L, generator=g) > 0.3
    allowed[..., -1] = True                                   # the query's own slot
    mask = {"bool": allowed, "none": None,
            "float": torch.zeros(B, 1, 1, L).masked_fill(~allowed, torch.finfo(torch.float32).min)}[mask_kind]
    module = SimpleNamespace(num_key_value_groups=H // Hkv)
    out, _ = _packed_gqa_sdpa(module, q, k, v, mask, scaling=0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1), attn_mask=mask, scale=0.3)
    assert out.shape == (B, 1, H, D)
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-6)


def test_generation_runs_the_packed_gqa_attention_and_restores_the_stock_one():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    stock = ALL_ATTENTION_FUNCTIONS["sdpa"]
    model, tok = _policy()
    seen = []
    attn = next(m for n, m in model.named_modules() if n.endswith("self_attn"))
    attn.register_forward_pre_hook(lambda *_: seen.append(ALL_ATTENTION_FUNCTIONS["sdpa"]))
    engine = HFEngine(stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    _generate(engine, model, SamplingSettings(temperature=1.0, max_new_tokens=4), 0, static=True)
    assert seen and all(f is _packed_gqa_sdpa for f in seen)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is stock
    with packed_gqa_decode_attention(), packed_gqa_decode_attention():   # nested: still restored
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is _packed_gqa_sdpa
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is stock


def test_decode_mode():
    assert decode_mode("cuda", True, "sdpa") == "graph" and decode_mode("cuda", True, "eager") == "graph"
    assert decode_mode("cpu", True, "sdpa") == "dynamic" and decode_mode("cuda", False, "sdpa") == "dynamic"
    assert decode_mode("cpu", True, "sdpa", static=True) == "static"
    assert decode_mode("cuda", True, "sdpa", static=False) == "dynamic"
    assert decode_mode("cuda", True, "flash_attention_2") == "dynamic"  # no explicit 4-D masks there
    assert decode_mode("cpu", False, "flash_attention_2", static=True) == "dynamic"
    assert decode_mode("cuda", True, "sdpa", window_fits=False) == "dynamic"


def test_sliding_window_models_decode_with_the_dynamic_cache_when_the_window_is_short():
    """A static cache keeps only the window's slots on sliding layers (Mistral, Qwen2 with
    use_sliding_window), so a static decode longer than the window would not fit its masks:
    such models fall back to the dynamic cache, whose tokens equal an unrestricted static decode's."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    from qerl.attention_masks import sliding_window_below

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2, pad_token_id=0)
    configs = [MistralConfig(sliding_window=8, **small),
               Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, **small)]
    assert not sliding_window_below(Qwen2Config(**small), 10_000)  # window off
    prompts = [[5, 6, 7, 8, 9, 10, 11], [11, 12]]
    for config in configs:
        assert sliding_window_below(config, 9) and not sliding_window_below(config, 8)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        engine = HFEngine(stop_token_ids=[2], pad_token_id=0)
        engine.sync(model)
        for new_tokens in (1, 6):  # prompt + completion 8 (fits the window: static) and 13 (dynamic)
            sampling = SamplingSettings(temperature=0.0, max_new_tokens=new_tokens)
            with torch.no_grad():
                static = engine._generate_chunk(prompts, sampling, torch.Generator().manual_seed(0), static=True)
            assert static.completion_ids == [_greedy_without_cache(model, p, new_tokens, eos=2) for p in prompts]


def _greedy_without_cache(model, prompt: list[int], new_tokens: int, eos: int) -> list[int]:
    """The reference decode: the whole unpadded sequence through the model at every step."""
    out = []
    with torch.no_grad():
        while len(out) < new_tokens and (not out or out[-1] != eos):
            out.append(int(model(input_ids=torch.tensor([prompt + out])).logits[0, -1].argmax()))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantization", ["nvfp4", "nf4", "bf16"])
def test_cuda_graph_decoder_equals_eager_gpu(quantization):
    """bf16-activation policy on the GPU (NVFP4: our Triton kernels; NF4: bitsandbytes): the
    graph-replayed static decoder against the eager dynamic one, greedy and sampled, with LoRA and AQN."""
    model, tok = _policy("sdpa", "cuda", "bf16", quantization)
    graphed = HFEngine([tok.eos_token_id], tok.pad_token_id, cuda_graphs=True)
    eager = HFEngine([tok.eos_token_id], tok.pad_token_id, cuda_graphs=False)
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=24)
    g, e = _generate(graphed, model, greedy, 0, None), _generate(eager, model, greedy, 0, None)
    assert g.completion_ids == e.completion_ids
    diff = max((torch.tensor(a) - torch.tensor(b)).abs().max().item() for a, b in zip(g.sampler_logprobs, e.sampler_logprobs))
    assert diff < 0.05, diff  # bf16: the static cache attends over more (masked) slots, summation order differs
    sampled = SamplingSettings(temperature=1.0, max_new_tokens=24)
    a, b = _generate(graphed, model, sampled, 5, None), _generate(graphed, model, sampled, 5, None)
    assert a.completion_ids == b.completion_ids  # replay is deterministic under the same seed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_capture_failure_falls_back_to_eager_gpu(caplog):
    """A module that syncs with the host (here a hook calling .item()) cannot be captured: the engine
    warns and finishes the chunk eagerly with the same tokens."""
    model, tok = _policy("sdpa", "cuda", "bf16")
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=16)
    expected = _generate(HFEngine([tok.eos_token_id], tok.pad_token_id, cuda_graphs=False), model, greedy, 0, None)
    layer = next(m for n, m in model.named_modules() if n.endswith("layers.0"))
    handle = layer.register_forward_hook(lambda mod, args, out: float(args[0].float().sum().item()) and None)
    try:
        got = _generate(HFEngine([tok.eos_token_id], tok.pad_token_id, cuda_graphs=True), model, greedy, 0, None)
    finally:
        handle.remove()
    assert got.completion_ids == expected.completion_ids
    assert "capture of the decode step failed" in caplog.text
    # the failed capture left nothing behind: default stream current, allocator usable and releasable
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.empty(1 << 20, device="cuda").sum().item()
    torch.rand(8, device="cuda").sum().item()  # the default CUDA generator is no longer "capturing"
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def test_cache_keyword_follows_the_installed_transformers():
    """transformers 5.2x names the KV cache `cache` (dropping `past_key_values` in 5.40); the GPU image's
    5.17 knows only `past_key_values`: the engine asks the model's own forward, through peft too."""
    from qerl.rollout.hf import cache_keyword, returned_cache

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return {"past_key_values": "kv"}

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None):
            return {"cache": "kv"}

    class Wrapped(torch.nn.Module):  # like peft's PeftModel: forward(**kwargs), the real one underneath
        def __init__(self, base):
            super().__init__()
            self.base = base

        def get_base_model(self):
            return self.base

        def forward(self, *args, **kwargs):
            return self.base(*args, **kwargs)

    assert cache_keyword(Old()) == "past_key_values" and cache_keyword(Wrapped(Old())) == "past_key_values"
    assert cache_keyword(New()) == "cache" and cache_keyword(Wrapped(New())) == "cache"
    assert returned_cache({"cache": 1}) == 1
    import transformers

    tiny = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
                                                                  num_hidden_layers=1, num_attention_heads=2,
                                                                  num_key_value_heads=1))
    out = tiny(input_ids=torch.tensor([[1, 2]]), use_cache=True)
    assert returned_cache(out) is not None


def test_non_finite_logits_are_named_not_a_sampler_error():
    model, tok = _policy()
    engine = HFEngine(stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, max_batch_size=8)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).fill_(float("nan"))
    with pytest.raises(RuntimeError, match="non-finite logits within the first 4 generated tokens: .*hold NaN / inf"):
        _generate(engine, model, SamplingSettings(temperature=1.0, max_new_tokens=4), 0, static=False)


def test_inverse_cdf_sampling_draws_the_distribution_and_never_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25, 0.0]])  # unnormalised rows work too (x 3 below)
    u = torch.rand(200_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    drawn = sample_inverse_cdf(3 * probs.expand(len(u), -1), u)  # (200000,)
    freq = torch.bincount(drawn, minlength=6).double() / len(u)
    assert freq[[0, 2, 5]].sum() == 0  # zero-probability tokens: never
    assert torch.allclose(freq, probs[0].double(), atol=4e-3)  # ~4 standard errors at n = 2e5
    edges = torch.tensor([0.0, 0.5 - 1e-12, 0.5, 0.75 - 1e-12, 0.75, 1 - 1e-12], dtype=torch.float64)
    assert sample_inverse_cdf(probs.expand(6, -1), edges).tolist() == [1, 1, 3, 3, 4, 4]


def test_a_prompts_samples_do_not_depend_on_its_batch_or_chunking():
    """Per-prompt seeds (evaluation): the same completions whoever else shares the call or the chunk;
    an int seed still gives every row its own draws (different samples of one prompt)."""
    model, tok = _policy()
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=8)
    seeds = [101, 202, 303, 404]

    def run(prompts, prompt_seeds_, batch):
        engine = HFEngine(stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, max_batch_size=batch)
        engine.sync(model)
        return engine.generate(prompts, 3, sampling, seed=prompt_seeds_).completion_ids

    whole = run(PROMPTS, seeds, 16)
    assert run(PROMPTS, seeds, 2) == whole  # chunked differently
    assert run(PROMPTS[2:], seeds[2:], 16) == whole[6:]  # without the other prompts
    assert run([PROMPTS[1], PROMPTS[0]], [seeds[1], seeds[0]], 16) == whole[3:6] + whole[:3]  # reordered
    assert len({tuple(c) for c in whole[:3]}) > 1  # the samples of one prompt differ
    engine = HFEngine(stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, max_batch_size=16)
    engine.sync(model)
    assert engine.generate(PROMPTS, 3, sampling, seed=7).completion_ids == run(PROMPTS, prompt_seeds(7, 4), 16)
    with pytest.raises(ValueError, match="3 prompt seeds for 4 prompts"):
        engine.generate(PROMPTS, 1, sampling, seed=seeds[:3])
    with pytest.raises(ValueError, match="prompt 1 has no tokens"):  # (an all-empty batch had no shape)
        engine.generate([PROMPTS[0], []], 1, sampling, seed=0)
    assert torch.equal(sample_uniforms(5, 1, 4), sample_uniforms(5, 1, 4))
    assert not torch.equal(sample_uniforms(5, 1, 4), sample_uniforms(5, 2, 4))


def test_rows_that_stop_early_under_top_p_are_not_taken_for_non_finite_logits():
    """A stopped row decodes padding, whose log-prob is -inf when the pad token is outside the row's
    top-p set: that is not a NaN in the model (it raised "non-finite logits" in evaluation, top-p 0.95)."""
    model, tok = _policy()
    stops = list(range(0, model.config.vocab_size, 3))  # a third of the vocabulary ends a completion
    engine = HFEngine(stop_token_ids=stops, pad_token_id=tok.pad_token_id, max_batch_size=16)
    engine.sync(model)
    gen = engine.generate(PROMPTS, 4, SamplingSettings(temperature=1.0, top_p=0.5, max_new_tokens=12), seed=0)
    lengths = [len(c) for c in gen.completion_ids]
    assert min(lengths) < max(lengths) and "stop" in gen.finish_reasons  # rows stopped while others decoded
    assert all(math.isfinite(lp) for row in gen.sampler_logprobs for lp in row)


def _tokenizer_with(template: str, eos: str, specials: tuple[str, ...] = ()):
    from tokenizers import AddedToken

    from qerl.tiny import build_tiny_tokenizer
    tok = build_tiny_tokenizer()
    tok.add_tokens([AddedToken(s, special=True) for s in specials], special_tokens=True)
    tok.chat_template, tok.eos_token = template, eos
    return tok


LLAMA3_TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}"
                   "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
                   "\n\n{% endif %}")


@pytest.mark.parametrize("template, eos, specials, turn_end", [
    (None, "<|endoftext|>", (), None),  # the tiny ChatML template, a base model's EOS
    (LLAMA3_TEMPLATE, "<|endoftext|>", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "<|eot_id|>"),
    ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", "<|endoftext|>", (), "none"),
    ("{{ raise_exception('a system message is required') }}", "<|endoftext|>", (), "none"),
])
def test_the_chat_templates_end_of_turn_stops_a_completion(template, eos, specials, turn_end):
    """Qwen2.5-7B (base) has a ChatML template but EOS <|endoftext|>: <|im_end|> must stop its
    completions too (they ran on to max_new_tokens, truncated, scored on text past the turn). A
    turn that ends in plain text, or a template that does not render, adds no stop token."""
    from qerl.rollout.base import end_of_turn_token, stop_token_ids
    from qerl.tiny import CHATML_TEMPLATE
    tok = _tokenizer_with(template or CHATML_TEMPLATE, eos, specials)
    want = tok.convert_tokens_to_ids(turn_end or "<|im_end|>") if turn_end != "none" else None
    assert end_of_turn_token(tok) == want
    assert stop_token_ids(tok) == sorted({tok.eos_token_id} | ({want} if want is not None else set()))


def test_a_base_tokenizer_stops_at_im_end_in_the_engine():
    """End to end: a model that soon picks <|im_end|> greedily stops there ('stop'), it does not run on."""
    model, _ = _policy(quantization="bf16")
    from qerl.tiny import CHATML_TEMPLATE
    tok = _tokenizer_with(CHATML_TEMPLATE, "<|endoftext|>")
    model.generation_config.eos_token_id = tok.eos_token_id
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        model.base_model.model.lm_head.weight[im_end] = 50 * model.base_model.model.model.norm.weight
    engine = HFEngine.for_model(model, tok)
    engine.sync(model)
    prompt = tok.apply_chat_template([{"role": "user", "content": "1+1?"}], add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    gen = engine.generate([list(prompt)], 1, SamplingSettings(0.0, max_new_tokens=8), 0)
    assert im_end in engine.stop_token_ids and tok.eos_token_id != im_end
    assert gen.completion_ids[0][-1] == im_end and len(gen.completion_ids[0]) < 8 and gen.finish_reasons[0] == "stop"
