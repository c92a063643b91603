"""Conversions between qerl's objects and the colocated vLLM engine's (``qerl/rollout/vllm.py``): the
LoRA rank vLLM accepts, HF norm names as vLLM names them, the policy's LoRA A/B tensors and config as
vLLM loads them, ``SamplingSettings`` as ``SamplingParams`` arguments, and vLLM's outputs as a
``Generation``. Pure functions: none imports ``vllm``, so they are tested on CPU without it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from qerl.adapter import hf_name
from qerl.rollout.base import Generation, NonFiniteLogits, SamplingSettings

ALLOWED_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks


def allowed_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that is >= ``rank``."""
    for r in ALLOWED_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {ALLOWED_LORA_RANKS[-1]}")


def hf_to_vllm_norm_name(name: str) -> str:
    """vLLM parameter name of a norm given by HF module or parameter name, peft-wrapped or not:
    ``base_model.model.model.layers.3.input_layernorm`` -> ``model.layers.3.input_layernorm.weight``.
    Qwen2/Qwen3/Llama norms keep their HF names in vLLM (vllm.md §3.2)."""
    name = hf_name(name)
    return name if name.endswith(".weight") else f"{name}.weight"


def adapter_tensors(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA A/B tensors under PEFT file names (``base_model.model.<m>.lora_A.weight``, no
    adapter name), as fresh CPU copies: vLLM scales B in place when it loads them."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model, save_embedding_layers=False)  # (no frozen lm_head copy)
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()
               if k.endswith((".lora_A.weight", ".lora_B.weight"))}
    # anything else peft trains (an embedding's lora_embedding_A/B, DoRA's magnitudes) would not reach
    # vLLM: it would sample from another policy than the one trained
    left_out = sorted(k for k in state if k not in tensors and "lora_" in k)
    if left_out:
        raise ValueError(f"the vLLM engine pushes LoRA A/B of linears only, not {left_out[:3]}"
                         f"{' ...' if len(left_out) > 3 else ''}: drop those modules from model.lora.target_modules "
                         "or use engine: hf")
    return tensors


def adapter_config(peft_model: nn.Module) -> dict[str, Any]:
    """The active adapter's config in the fields vLLM's ``PEFTHelper`` reads (no modules_to_save:
    trainable norms travel as base weights, vllm.md §2)."""
    if not hasattr(peft_model, "peft_config"):
        raise ValueError("the vLLM engine needs a peft LoRA policy")
    cfg = peft_model.peft_config[peft_model.active_adapter]
    if getattr(cfg, "rank_pattern", None) or getattr(cfg, "alpha_pattern", None) or cfg.use_dora:
        raise ValueError("vLLM supports one rank/alpha for all modules and no DoRA")
    targets = cfg.target_modules
    return {"r": int(cfg.r), "lora_alpha": cfg.lora_alpha, "bias": cfg.bias, "use_rslora": bool(cfg.use_rslora),
            "use_dora": False, "modules_to_save": None, "peft_type": "LORA",
            "target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets}


# vLLM 0.25's SamplingParams raises a temperature in (0, 0.01) to 0.01 with only a log line, and refuses
# one above 2 at the first request: the first would sample (and report log-probs) at another temperature
# than the trainer divides by, the second would fail after the export and the engine start.
VLLM_TEMPERATURES = (1e-2, 2.0)


def check_vllm_temperature(temperature: float, name: str) -> None:
    """A ValueError naming ``name`` when vLLM would not sample at ``temperature`` (0: greedy, fine)."""
    low, high = VLLM_TEMPERATURES
    if temperature > 0 and not low <= temperature <= high:
        raise ValueError(f"{name}={temperature}: vLLM samples at temperatures in [{low}, {high}] (or 0, greedy); it "
                         f"would {'raise it to ' + str(low) if temperature < low else 'refuse it'}, and the trainer "
                         "divides the logits by the configured one (use engine: hf for such a temperature)")


def sampling_params_kwargs(sampling: SamplingSettings, n: int) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments but the per-request seed. Greedy (temperature <= 0)
    returns ``n=1`` (vLLM refuses n > 1 when greedy; the caller repeats the prompt). ``logprobs=0``:
    only the sampled token's log-prob comes back."""
    common = dict(max_tokens=int(sampling.max_new_tokens), logprobs=0, detokenize=False)
    if sampling.temperature <= 0:
        return dict(n=1, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, **common)
    return dict(n=int(n), temperature=float(sampling.temperature), top_p=float(sampling.top_p),
                top_k=max(int(sampling.top_k), 0), min_p=float(sampling.min_p), **common)


def outputs_to_generation(request_outputs) -> Generation:
    """vLLM ``RequestOutput`` list (prompt order) -> ``Generation``, prompt-major, samples by index."""
    gen = Generation([], [], [])
    for ro in request_outputs:
        for _, co in sorted(enumerate(ro.outputs), key=lambda kc: getattr(kc[1], "index", kc[0])):
            ids = [int(t) for t in co.token_ids]
            if co.logprobs is None or len(co.logprobs) != len(ids):
                raise ValueError("vLLM returned no per-token logprobs (SamplingParams.logprobs must be 0)")
            if co.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished a completion with {co.finish_reason!r}")
            logprobs = [float(pos[t].logprob) for t, pos in zip(ids, co.logprobs)]
            if not all(map(math.isfinite, logprobs)):  # a sampled token's log-prob is finite unless the logits are not
                raise NonFiniteLogits("vLLM sampled from non-finite logits: the policy's weights or the AQN noise "
                                      "hold NaN / inf, or overflow")
            gen.completion_ids.append(ids)
            gen.sampler_logprobs.append(logprobs)
            gen.finish_reasons.append(co.finish_reason)
    return gen
