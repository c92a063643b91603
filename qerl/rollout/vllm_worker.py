"""Functions the vLLM engine runs *inside* vLLM (``collective_rpc`` on the worker, ``apply_model``
on its model), written against vLLM 0.25.0's private worker API (research/vllm.md §3.3.3).

They are kept apart from ``qerl.rollout.vllm`` because they touch vLLM internals: on a vLLM
upgrade this file is the one to re-check (``pyproject.toml`` pins ``vllm<0.26`` for that reason).
"""

from __future__ import annotations

import torch
from torch import nn

_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def expected_lora_modules(adapter_manager) -> set[str] | None:
    """Module short names vLLM's LoRA manager can apply an adapter to, with packed layers expanded
    (``qkv_proj`` -> ``q_proj, k_proj, v_proj``), as vLLM's own disk loader computes them
    (``WorkerLoRAManager._load_adapter``). None when this vLLM does not expose them."""
    supported = getattr(adapter_manager, "supported_lora_modules", None)
    if supported is None:
        return None
    packed = getattr(adapter_manager, "packed_modules_mapping", None) or {}
    expected: set[str] = set()
    for module in supported:
        expected.update(packed.get(module, [module]))
        if module == "experts":
            expected.add(module)
    return expected


def unexpected_lora_modules(tensor_names, expected: set[str]) -> list[str]:
    """Adapter modules (PEFT names without the ``.lora_A/B.weight`` suffix) whose last name part
    vLLM would not apply. vLLM's in-memory path does not check this itself: it silently leaves
    such modules out (debug log only), so rollouts would sample from another policy than the
    one being trained."""
    modules = sorted({n[: -len(sfx)] for n in tensor_names for sfx in _LORA_SUFFIXES if n.endswith(sfx)})
    return [m for m in modules if m.rsplit(".", 1)[-1] not in expected]


def install_tensor_lora_loader(worker, registry: dict[int, tuple[dict, dict]]) -> bool:
    """Called on vLLM's worker (``collective_rpc``): wrap ``lora_manager._load_adapter`` so that an
    id found in ``registry`` (id -> (tensors, peft config)) is built from memory. Mirrors 0.25's
    ``WorkerLoRAManager._load_adapter`` (vllm/lora/worker_manager.py), including its check that
    every adapter module is one vLLM applies; other ids load as usual."""
    mgr = worker.model_runner.lora_manager
    if getattr(mgr, "_qerl_tensor_loader", False):
        return True
    original = mgr._load_adapter

    def _load_adapter(lora_request):
        entry = registry.get(lora_request.lora_int_id)
        if entry is None:
            return original(lora_request)
        from vllm.lora.peft_helper import PEFTHelper

        tensors, config = entry
        expected = expected_lora_modules(mgr._adapter_manager)
        bad = unexpected_lora_modules(tensors, expected) if expected is not None else []
        if bad:
            raise ValueError(f"vLLM cannot apply LoRA to {bad[:4]} (it applies LoRA to {sorted(expected)}); "
                             "drop those names from the LoRA target_modules or use engine: hf")
        helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": mgr.max_position_embeddings})
        helper.validate_legal(mgr.lora_config)
        model = mgr._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = mgr._lora_model_cls.from_lora_tensors(
            lora_model_id=lora_request.lora_int_id, tensors=tensors, peft_helper=helper, device="cpu",
            dtype=mgr.lora_config.lora_dtype, model_vocab_size=mgr.vocab_size,
            weights_mapper=mapper.get_unstacked_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        lora.is_3d_lora_weight = lora_request.is_3d_lora_weight
        return lora

    mgr._load_adapter = _load_adapter
    mgr._qerl_tensor_loader = True
    return True


@torch.no_grad()
def copy_norm_scales(model: nn.Module, scales: dict[str, torch.Tensor]) -> float:
    """Called with vLLM's model (``apply_model``): ``param.data.copy_`` each scale (vLLM names) in
    place, cast to the parameter dtype; returns the largest rounding error of that cast."""
    params = dict(model.named_parameters())
    missing = [n for n in scales if n not in params]
    if missing:
        raise KeyError(f"vLLM's model has no parameters {missing[:3]}; e.g. {list(params)[:3]}")
    err = torch.zeros((), dtype=torch.float32)
    for name, value in scales.items():
        p = params[name]
        if p.shape != value.shape:
            raise ValueError(f"{name}: vLLM shape {tuple(p.shape)} != {tuple(value.shape)}")
        src = value.detach().to(p.device, torch.float32)
        p.data.copy_(src)
        err = torch.maximum(err, (p.data.float() - src).abs().max().cpu())
    return float(err)


def max_model_len(llm) -> int | None:
    """The engine's context limit (prompt + completion), or None if this vLLM hides it."""
    config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    value = getattr(config, "max_model_len", None)
    return int(value) if value is not None else None
