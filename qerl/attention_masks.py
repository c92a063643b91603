"""Explicit 4-D attention masks for left-padded batches (the trainer's passes, the engine's prefill).

A left-padded row's padding queries have no key to attend to: every key up to them is padding. What
SDPA returns for such a fully masked query row depends on the backend. On the H200 (torch 2.11,
transformers 5.17) a boolean mask selects cuDNN attention, whose forward gives arbitrary finite
values there and whose backward, at some shapes, non-finite dq (B = 32, L = 704, 14 heads: 1.7 M
non-finite elements; L = 640 or 300: none; `efficient` and `math` give 0 and finite gradients). The
padding row's output gradient is 0, but 0 * NaN poisons the LoRA gradients of every layer below, so
the update was skipped as non-finite (the testbed fit with the official prompt, steps 2-3 and 4-5).

Letting each padding query attend to itself removes every fully masked row and changes no real
token's attention: a real query never sees a padding key, and its own key is already allowed.
That alone did not save the testbed run: with the explicit mask, the same seed's batch (32 x 704
tokens) still got non-finite dq from cuDNN, in 428 (row, head) pairs of layer 8 (the isolated test
shape then passes). Keeping cuDNN out of every training pass fixed it (0 skipped updates in 3 seeds)
but costs: the memory-efficient backend takes 1.9-2.5x cuDNN's time for a 7B layer's masked
attention forward + backward (results/attention_backends_h200.json). So the trainer keeps cuDNN and,
when an update's gradient norm comes out non-finite with it, recomputes that update inside
:func:`without_cudnn_attention` (flash, memory-efficient and math remain) before giving up on it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

EXPLICIT_MASK_IMPLEMENTATIONS = ("sdpa", "eager")  # those that take a 4-D mask as given (flash: varlen unpadding)


def sliding_window_below(config, length: int) -> bool:
    """Whether some attention layer of ``config`` sees only a window shorter than ``length`` tokens
    (Mistral, Qwen2 with ``use_sliding_window``, Gemma-style ``layer_types``). A full causal mask
    would drop the window (and the engine's static cache keeps just the window)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(config, "sliding_window", None)
    if not window or window >= length:
        return False
    layer_types = getattr(config, "layer_types", None)
    return layer_types is None or "sliding_attention" in layer_types


def padded_causal_mask(valid: Tensor, queries: int | None = None) -> Tensor:
    """``(B, 1, queries, L)`` bool, True = attend: query i sees key j <= i that holds a real token
    (``valid``, (B, L)), and always itself. Queries are slots ``0 .. queries-1`` (default all L; the
    engine's prefill passes its prompt length, the keys include the slots still to be generated)."""
    L = valid.shape[1]
    queries = L if queries is None else queries
    j = torch.arange(L, device=valid.device)
    i = j[:queries, None]  # (q, 1)
    allowed = (j[None, :] <= i) & (valid.bool()[:, None, :] | (j[None, :] == i))  # (B, q, L)
    return allowed[:, None]


def model_mask(allowed: Tensor, eager: bool, dtype: torch.dtype) -> Tensor:
    """``allowed`` as the attention implementation takes it: sdpa a bool mask, eager an additive
    float one (0 where allowed, the dtype's minimum elsewhere)."""
    if not eager:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def left_padding_mask(model, attention_mask: Tensor) -> Tensor:
    """The mask to feed ``model`` for ``attention_mask`` (B, L): the 2-D mask itself when no row
    starts with padding (transformers may then skip the mask) or the model's attention takes no
    explicit mask, else :func:`padded_causal_mask` in the model's format."""
    config = model.config
    impl = getattr(config, "_attn_implementation", "sdpa")
    if bool(attention_mask[:, 0].all()) or impl not in EXPLICIT_MASK_IMPLEMENTATIONS:
        return attention_mask
    if sliding_window_below(config, attention_mask.shape[1]):
        return attention_mask
    dtype = model.get_input_embeddings().weight.dtype
    return model_mask(padded_causal_mask(attention_mask), impl == "eager", dtype)


def cudnn_attention_enabled(device: torch.device) -> bool:
    """Whether SDPA may run cuDNN attention for tensors on ``device`` (CUDA, and not switched off)."""
    return torch.device(device).type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled()


@contextlib.contextmanager
def without_cudnn_attention():
    """SDPA may pick any backend but cuDNN's in here (a process-wide setting, so the autograd
    thread's checkpoint recompute sees it too): the trainer's retried update, forward and backward.
    Changes nothing on the CPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        yield
