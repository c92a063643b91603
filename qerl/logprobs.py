"""Logits -> per-token log-probs and entropy, in fp32 without a full-vocabulary fp32 copy.

At V = 152k one 4k-token sequence of logits is 1.2 GB in bf16 and 2.5 GB in fp32, so both functions
work `chunk_size` positions at a time; `selective_log_softmax` also differentiates chunk by chunk.
Both divide by the sampling temperature in fp32, as the samplers do.
"""

from __future__ import annotations

import torch
from torch import Tensor


def entropy_from_logits(logits: Tensor, chunk_size: int = 512, temperature: float = 1.0) -> Tensor:
    """Per-position entropy of softmax(logits / temperature): (..., V) -> (...), float32.

    H = logsumexp(z) - sum_v softmax(z)_v * z_v, computed in fp32 (bf16 would lose the small
    differences between near-equal logits). Rows are processed `chunk_size` positions at a time,
    so the fp32 temporaries are (chunk_size, V) rather than a full fp32 copy of the logits
    (at V = 152k, one 4k-token sequence is 2.5 GB in fp32). Usually called under no_grad for
    logging; it stays differentiable, but then autograd keeps each chunk's fp32 temporaries.
    Logits of -inf (masked vocabulary) contribute 0 rather than NaN. The temperature divides in fp32
    too (a bf16 division would round every logit: up to 0.1 nats off at T = 0.7).
    """
    vocab = logits.size(-1)
    flat = logits.reshape(-1, vocab)  # (R, V)
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    entropies = []
    for chunk in flat.split(chunk_size, dim=0):
        z = chunk.to(compute_dtype) / temperature  # (r, V)
        lse = torch.logsumexp(z, dim=-1, keepdim=True)  # (r, 1)
        logp = z - lse  # (r, V)
        probs = torch.exp(logp)  # (r, V)
        # -sum p log p, not lse - sum p z: at a low temperature z / T is large and those two nearly equal
        # terms cancelled (25 nats off at T = 1e-3, a negative entropy logged). Zero the -inf logits
        # *before* multiplying: 0 * -inf is NaN, in the value and in its gradient
        logp_finite = torch.where(probs > 0, logp, torch.zeros((), dtype=z.dtype, device=z.device))
        entropies.append(-(probs * logp_finite).sum(dim=-1))  # (r,)
    return torch.cat(entropies).view(logits.shape[:-1])


class _SelectiveLogSoftmax(torch.autograd.Function):
    """log_softmax(logits / T)[ids] computed and differentiated chunk by chunk in fp32.

    Autograd through `logits.float().log_softmax()` would save an fp32 (R, V) tensor for backward,
    twice the bf16 logits. Here only the logits (already alive) and the (R,) logsumexp are saved;
    backward recomputes softmax one chunk at a time: d logp(id) / d z_v = (1[v = id] - softmax(z / T)_v) / T.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, ids: Tensor, chunk_size: int, temperature: float) -> Tensor:
        flat = logits.reshape(-1, logits.size(-1))  # (R, V)
        flat_ids = ids.reshape(-1, 1)  # (R, 1)
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        chunks = flat.split(chunk_size)
        lse = torch.cat([torch.logsumexp(c.to(compute_dtype) / temperature, dim=-1) for c in chunks])  # (R,)
        picked = flat.gather(-1, flat_ids).squeeze(-1).to(compute_dtype) / temperature  # (R,)
        ctx.save_for_backward(logits, ids, lse)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        return (picked - lse).view(ids.shape)

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None, None, None]:
        logits, ids, lse = ctx.saved_tensors
        T = ctx.temperature
        flat = logits.reshape(-1, logits.size(-1))  # (R, V)
        flat_ids = ids.reshape(-1, 1)  # (R, 1)
        grad_flat = grad_out.reshape(-1, 1).to(lse.dtype) / T  # (R, 1): the chain rule's 1 / T
        grad_logits = torch.empty_like(flat)  # (R, V), logits' dtype
        for start in range(0, flat.size(0), ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            probs = torch.exp(flat[rows].to(lse.dtype) / T - lse[rows, None])  # (r, V)
            chunk_grad = -probs * grad_flat[rows]  # (r, V)
            chunk_grad.scatter_add_(-1, flat_ids[rows], grad_flat[rows])
            grad_logits[rows] = chunk_grad.to(grad_logits.dtype)
        return grad_logits.view_as(logits), None, None, None


def selective_log_softmax(logits: Tensor, ids: Tensor, chunk_size: int = 512, temperature: float = 1.0) -> Tensor:
    """Log-probs of the given token ids: (..., V), (...) -> (...) float32 (float64 for float64 input).

    Exactly log_softmax(logits.float() / temperature, -1).gather(-1, ids), but the fp32 work is done
    `chunk_size` positions at a time and backward recomputes softmax per chunk, so neither pass
    materialises an fp32 (..., V) tensor. The temperature divides in fp32, as the samplers do (a bf16
    division first would round every logit).
    """
    return _SelectiveLogSoftmax.apply(logits, ids, chunk_size, float(temperature))
