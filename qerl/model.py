"""Load a causal LM, freeze it, quantize its decoder linears to NVFP4 layer by layer, add LoRA.

Sources (``name_or_path``):
- ``tiny-qwen2`` / ``tiny-llama``: random tiny models built in code (quickstart, tests);
- a local directory or a Hugging Face id (``transformers.from_pretrained``), not an already quantized
  one (compressed-tensors, GPTQ, AWQ, ...: refused);
- a ``.gguf`` file (transformers dequantizes it on load; needs the ``gguf`` package).

The full model is first materialized on the CPU in 16 bits; its decoder linears are then quantized
one layer at a time (``qerl.quantize``: which linears, NVFP4 / NF4, the base's bytes). The LoRA side
is here too: ``LoraSettings`` and ``add_lora`` (trained norms as fp32 masters and the adapter-off base:
``qerl.norms``).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import math
import os
import re
import struct
import warnings
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn as nn
from safetensors import SafetensorError
from transformers import (AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase,
                          PreTrainedTokenizerFast)

from qerl.hub_offline import go_offline_if_hub_unreachable
from qerl.lora_forward import compute_in_activation_dtype
from qerl.norms import hold_norm_in_fp32, is_norm_scale, restore_base_norms
from qerl.quantize import (
    DECODER_LINEARS, base_weight_bytes, check_decoder_linears, count_parameters, quantize_decoder_linears,
    quantize_decoder_linears_nf4,
)
from qerl.settings_checks import require_numbers
from qerl.tiny import TINY_MODEL_NAMES, build_tiny_model, build_tiny_tokenizer

log = logging.getLogger(__name__)

Quantization = Literal["bf16", "nf4", "nvfp4"]


def _parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
             "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(table)}")
    return table[dtype]


# What a bad model path, a corrupt or truncated .gguf / .safetensors or an unreadable folder raises
# inside transformers (struct.error: a GGUF header cut short); reported as one line by _load_error.
_LOAD_ERRORS = (OSError, ValueError, RuntimeError, KeyError, struct.error, SafetensorError)


def _load_error(name_or_path: str, err: Exception) -> ValueError:
    cause = " ".join(str(err).split())[:300] or type(err).__name__  # one line, the whole cause
    path = os.path.expanduser(name_or_path)
    if os.path.isfile(path) or os.path.isdir(path):  # it was found: its files are what failed
        what = "the file" if os.path.isfile(path) else "the folder's config, weights or tokenizer"
        return ValueError(f"cannot load model {name_or_path!r}: {what} could not be read ({cause})")
    return ValueError(
        f"cannot load model {name_or_path!r}: not a tiny model name ({', '.join(TINY_MODEL_NAMES)}), "
        f"a local model directory, a .gguf file, or a reachable Hugging Face id ({cause})"
    )


# What the hub takes without a local path: ``owner/name``, or one of its legacy single-segment ids
# (``gpt2``, ``bert-base-uncased``: lower case, digits and dashes; never a dot, as in ``qwen2.5-7b``).
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+|[a-z0-9]+(?:-[a-z0-9]+)*")
_PATH_PREFIXES = ("/", "./", "../", "~")


def _model_source(name_or_path: str) -> tuple[str, dict]:
    """(folder or id, extra from_pretrained kwargs) for a model that is not a tiny one: a .gguf file
    becomes its folder + ``gguf_file``, ``~`` is expanded. A name that can only be a typo (a misspelled
    tiny model, a path that does not exist, neither a path nor a hub id) is a ValueError at once: the
    hub lookup it would get instead retries for most of a minute offline."""
    path = os.path.expanduser(name_or_path)
    if name_or_path.lower().endswith(".gguf"):  # (a file name's case: Model.GGUF is a GGUF too)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file not found: {name_or_path}")
        folder, gguf_file = os.path.split(os.path.abspath(path))
        return folder, {"gguf_file": gguf_file}
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        what = ("a peft adapter folder (give it as model.adapter_path, with its base as the model)"
                if os.path.isfile(os.path.join(path, "adapter_config.json")) else "not a Hugging Face model folder")
        raise ValueError(f"cannot load model {name_or_path!r}: the folder has no config.json: {what}")
    if os.path.isfile(path):  # (transformers would read the path as a hub id and blame its form)
        raise ValueError(f"cannot load model {name_or_path!r}: a file that is not a .gguf; give the model's folder")
    if os.path.exists(path):
        return path, {}
    if name_or_path.startswith("tiny-") and "/" not in name_or_path:  # (a hub owner may be tiny-...)
        close = difflib.get_close_matches(name_or_path, TINY_MODEL_NAMES, n=1)
        hint = f": did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown built-in model {name_or_path!r}{hint} (built-in: {', '.join(TINY_MODEL_NAMES)})")
    if name_or_path.startswith(_PATH_PREFIXES):
        raise ValueError(f"cannot load model {name_or_path!r}: no such file or directory")
    if not _HUB_ID.fullmatch(name_or_path):
        raise ValueError(f"cannot load model {name_or_path!r}: no such local file or directory, and not a Hugging "
                         f"Face id (owner/name, e.g. Qwen/Qwen2.5-7B-Instruct) or a tiny model name "
                         f"({', '.join(TINY_MODEL_NAMES)})")
    go_offline_if_hub_unreachable()  # offline, a cached id loads at once instead of after minutes of retries
    return name_or_path, {}


def _refuse_prequantized(name_or_path: str, quantization_config: object) -> None:
    """A checkpoint that is already quantized (compressed-tensors, as ``qerl.export --format nvfp4``
    writes it; GPTQ, AWQ, bitsandbytes, ...) loads as its quantizer's own linear modules, which qerl
    can neither quantize nor wrap with LoRA: a ValueError naming its ``quant_method``."""
    if not quantization_config:
        return
    method = (quantization_config.get("quant_method") if isinstance(quantization_config, dict)
              else getattr(quantization_config, "quant_method", None))
    method = getattr(method, "value", method) or "unknown"  # transformers' QuantizationMethod enum
    raise ValueError(
        f"cannot load model {name_or_path!r}: it is a {method} (pre-quantized) checkpoint, which cannot be the "
        "trained base; use the original model, or a bf16 export of it (python -m qerl.export --model ORIGINAL "
        "--format bf16)"
    )


def _local_quantization_config(source: str) -> dict | None:
    """``quantization_config`` of a local model folder's config.json (None for hub ids, folders without
    one and unreadable files, which from_pretrained reports itself)."""
    try:
        with open(os.path.join(source, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config.get("quantization_config") if isinstance(config, dict) else None


# The generic classes of a tokenizer that is its tokenizer.json and nothing else (ours for the tiny
# models, Llama 3's): transformers 5 replaces them by the config's model-type class (a Qwen2 config
# gets Qwen2Tokenizer, rebuilt with other pre-tokenization: an exported tiny model lost its spaces)
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _file_exact_tokenizer_class(source: str):
    """``PreTrainedTokenizerFast`` for a local folder whose tokenizer_config.json names a generic class
    and which has a tokenizer.json; else ``AutoTokenizer``."""
    try:
        with open(os.path.join(source, "tokenizer_config.json")) as f:
            named = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return AutoTokenizer
    exact = named in _GENERIC_TOKENIZER_CLASSES and os.path.isfile(os.path.join(source, "tokenizer.json"))
    return PreTrainedTokenizerFast if exact else AutoTokenizer


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """The model's tokenizer alone (cheap: the DataModule needs it before the model is built)."""
    if name_or_path in TINY_MODEL_NAMES:
        return build_tiny_tokenizer()
    source, extra = _model_source(name_or_path)
    try:
        tokenizer = _file_exact_tokenizer_class(source).from_pretrained(source, **extra)
    except _LOAD_ERRORS as err:
        raise _load_error(name_or_path, err) from err
    if len(tokenizer) <= 1:  # transformers 5 makes an empty tokenizer of a folder without tokenizer files
        raise _load_error(name_or_path, ValueError("its tokenizer has no vocabulary (no tokenizer files there?)"))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_base_model(
    name_or_path: str, dtype: str | torch.dtype = "bf16", seed: int = 0
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load model and tokenizer on the CPU, in ``dtype``, without quantizing anything yet.
    A pre-quantized checkpoint is refused: a local folder's before any weight loads."""
    dtype = _parse_dtype(dtype)
    if name_or_path in TINY_MODEL_NAMES:
        arch = name_or_path.split("-", 1)[1]
        return build_tiny_model(arch, seed=seed, dtype=dtype), build_tiny_tokenizer()
    source, extra = _model_source(name_or_path)
    if not extra:  # a .gguf's dequantizing loader has a quantization_config of its own (DESIGN.md)
        _refuse_prequantized(name_or_path, _local_quantization_config(source))
    tokenizer = load_tokenizer(name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **extra)
    except _LOAD_ERRORS as err:
        raise _load_error(name_or_path, err) from err
    if not extra:  # a hub id's config is seen only now
        _refuse_prequantized(name_or_path, getattr(model.config, "quantization_config", None))
    # transformers' GGUF loader keeps a quantization_config that blocks save_pretrained (DESIGN.md).
    return model.eval(), tokenizer


@dataclass
class LoraSettings:
    """LoRA adapter settings (peft). Adapters stay unmerged: merging into FP4 is lossy.

    Args:
        rank: adapter rank r (the paper uses 32).
        alpha: scaling numerator; the update is scaled by alpha / rank.
        dropout: dropout on the adapter input (0 in QeRL). Above 0 every training forward draws a
            new mask: the first update's ratio to the old log-probs is no longer 1 (clipping fires
            before any step) and the sampler, which runs without dropout, differs from the trainer,
            so the importance weights correct noise rather than a real mismatch (a warning says so).
        target_modules: module-name suffixes that get adapters.
        trainable_norms: also train the RMSNorm scales before attention and MLP, as the official
            QeRL scripts do (``--ln True``); they are saved with the adapter and synced to the engine,
            train as fp32 master weights (bf16 would round lr-1e-5 steps away), and are back at their
            base values for the KL reference and adapter-off evaluation (as peft's modules_to_save).
        compute_dtype: ``model``: on a bf16 / fp16 model the adapters' matmuls run in that dtype on
            per-call casts of their fp32 weights, which the optimizer keeps updating in fp32 (as bf16
            autocast trains): two tensor-core GEMMs per linear with the add fused, where peft's fp32
            path casts every activation to fp32 and adds in fp32 (``qerl.lora_forward``; 7B-shaped
            update on the H200: see ``benchmarks/results/train_step_h200.json``). ``stored``: peft's
            fp32 forward. fp32 models compute the same either way. The embedded engine generates
            with ``RolloutCallback(hf_adapter_dtype: model)`` by default, the same arithmetic as
            ``model`` here; set both to ``stored`` for an all-fp32 adapter.
    """

    rank: int = 32
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DECODER_LINEARS))
    trainable_norms: bool = False
    compute_dtype: Literal["model", "stored"] = "model"

    def __post_init__(self):
        require_numbers(self, "model.lora")
        if not self.rank >= 1:
            raise ValueError(f"model.lora.rank must be >= 1, got {self.rank}")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):  # alpha 0 scales every update to nothing
            raise ValueError(f"model.lora.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if self.compute_dtype not in ("model", "stored"):
            raise ValueError(f"lora.compute_dtype must be 'model' or 'stored', got {self.compute_dtype!r}")


def lora_config(settings: LoraSettings, base_model: str | None = None):
    """peft's ``LoraConfig`` for these settings (``base_model``: recorded in ``adapter_config.json``)."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules), bias="none", task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )


@contextlib.contextmanager
def peft_wrapping_quietly():
    """peft's warnings when it wraps our linears that do not concern this codebase: TorchaoLoraLinear's
    merge() cannot re-quantize our subclass (intended: we never merge into FP4), and peft reads
    transformers 5's deprecated ``is_gradient_checkpointing``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*get_apply_tensor_subclass.*")
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def add_lora(model: PreTrainedModel, settings: LoraSettings) -> nn.Module:
    """Freeze the base and wrap the target linears with peft LoRA (NVFP4 linears become peft's
    ``TorchaoLoraLinear``, since our weight subclasses ``TorchAOBaseTensor``)."""
    from peft import get_peft_model

    for p in model.parameters():
        p.requires_grad_(False)
    # Never call peft's prepare_model_for_kbit_training: it reassigns `.data` of every 16-bit
    # param to fp32, which corrupts wrapper-subclass weights (research/torchao_nvfp4.md §5.3).
    config = lora_config(settings)
    with peft_wrapping_quietly():
        peft_model = get_peft_model(model, config)
    _check_every_target_matched(peft_model, settings.target_modules)
    if settings.compute_dtype == "model":
        compute_in_activation_dtype(peft_model)
    if settings.trainable_norms:
        base = {}
        for name, p in list(peft_model.named_parameters()):
            if is_norm_scale(name):
                base[name] = p.detach().clone()  # for the base-model passes (see base_model_only)
                hold_norm_in_fp32(peft_model, name)
        peft_model.qerl_base_norms = base  # a plain attribute: never in a state_dict or checkpoint
    return peft_model


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant), with the input embeddings
    requiring grad so that gradients reach the LoRA weights through the frozen layers. transformers
    renamed ``gradient_checkpointing_enable`` (deprecated, removed in v6) to
    ``activation_checkpointing_enable``; the image's 5.17 may predate the new name."""
    if hasattr(model, "activation_checkpointing_enable"):  # (a PeftModel forwards it to the base model)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()


def _check_every_target_matched(peft_model: nn.Module, targets: list[str]) -> None:
    """peft refuses a target list none of whose names matches, but drops a misspelled name beside a
    matching one (``[q_proj, donw_proj]`` trains q only), and the saved adapter_config.json repeats the typo."""
    wrapped = peft_model.base_model.targeted_module_names  # full module names, matched by suffix as peft does
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in wrapped)]
    if unmatched:
        leaves = sorted({n.rpartition(".")[2] for n in wrapped})
        raise ValueError(f"model.lora.target_modules: no module named {unmatched[0]!r} in the model "
                         f"(adapted: {', '.join(leaves)})")


def non_finite_tensors(tensors: dict) -> list[str]:
    """Names of the floating-point tensors of ``tensors`` that hold a NaN or an inf (a broken base, or
    weights saved after a training run diverged: refused rather than passed on)."""
    return [name for name, t in tensors.items()
            if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all())]


def refuse_non_finite_base(model: nn.Module, name_or_path: str) -> None:
    """One line when a dense weight of the base holds NaN / inf (the quantizers refuse theirs as they
    pack them): otherwise the first rollout fails on non-finite logits, blaming the policy."""
    dense = {name: p for name, p in model.named_parameters() if type(p) is nn.Parameter}
    if bad := non_finite_tensors(dense):
        raise ValueError(f"model {name_or_path!r}: {bad[0]} holds NaN / inf values (a broken checkpoint?)")


def load_policy(
    name_or_path: str,
    quantization: Quantization = "nvfp4",
    lora: LoraSettings | None = None,
    dtype: str | torch.dtype = "bf16",
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    """Everything in one call: load, quantize (``nvfp4``) or keep 16-bit (``bf16``), add LoRA."""
    model, tokenizer = load_base_model(name_or_path, dtype=dtype, seed=seed)
    check_decoder_linears(model)
    if quantization == "nvfp4":
        n = quantize_decoder_linears(model, device)
        log.info("quantized %d decoder linears to NVFP4", n)
    elif quantization == "nf4":
        n = quantize_decoder_linears_nf4(model, device)
        log.info("quantized %d decoder linears to NF4 (bitsandbytes, double quantization)", n)
    elif quantization == "bf16":
        model.to(device)
    else:
        raise ValueError(f"unknown quantization {quantization!r}; use 'bf16', 'nf4' or 'nvfp4'")
    refuse_non_finite_base(model, name_or_path)
    if lora is not None:
        model = add_lora(model, lora)
        restore_base_norms(model, name_or_path)
    sizes, counts = base_weight_bytes(model), count_parameters(model)
    trainable = (f"trainable params {counts['trainable']} of {counts['total']} "
                 f"({100 * counts['trainable'] / max(counts['total'], 1):.2f}%)" if lora is not None
                 else f"{counts['total']} params, no LoRA")  # (without LoRA nothing here is trained)
    log.info("base weights %.1f MB (decoder linears %.1f MB); %s",
             sizes["total"] / 1e6, sizes["decoder_linears"] / 1e6, trainable)
    return model, tokenizer
