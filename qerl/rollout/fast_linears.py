"""The linears of a generating model, made cheap: LoRA in two GEMMs, one launch per shared input.

Two contexts the embedded engine (``qerl.rollout.hf.HFEngine.generate``) enters while generating
only; training and the reference pass keep the model's adapter forwards (peft's LoRA, or with
``LoraSettings.compute_dtype: model`` the same ``plus_lora`` on casts made per call:
``qerl.lora_forward``), and on CUDA share only the third context's fused NVFP4 bases.

* ``lean_lora_forward``: each adapted linear runs ``base(x) + (x A^T) (s B)^T`` on copies of its
  adapter in the model's dtype, 2 kernels besides the base instead of peft's 4.
* ``fused_projections``: the projections that read the same input -- q/k/v of an attention block,
  gate/up of an MLP -- run as ONE linear over their concatenated frozen weights (NVFP4 or 16-bit),
  plus one LoRA-A GEMM over the concatenated A's and one GEMM with a block-diagonal scaled B. The
  model's q, k and v then read column slices of that output. Why: the separate launches are small
  and latency-bound (7B k/v: 512 rows each), and the kernels' pinned configs are tuned for the
  concatenated shapes (``kernels/presets_h200.json``: qkv N = 4608, gate_up N = 37888), which is
  also what vLLM runs. q/k/v and gate/up already share one NVFP4 per-tensor scale (``qerl.quantize``).

  No weight is copied for it: the first time, each group's packed codes and block scales (or
  16-bit weights) are concatenated once and every member's weight becomes a row-slice view of that
  buffer (the old storage is freed), so later generations find them already in place. The member
  forwards recognise their shared input by identity (``k_proj(x)`` after ``q_proj(x)``); a member
  called on any other input computes the group again (correct, only slower).
* ``fused_base_projections``: the training-time variant (``QeRLModule`` with ``fused_ops`` on CUDA):
  only the frozen NVFP4 bases of a group run as one linear, with autograd; the adapters stay the
  model's own.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from qerl.lora_forward import plain_adapter, plus_lora, scaled_adapter
from qerl.nvfp4 import NVFP4WeightTensor

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
NONE, LEAN, OTHER = "none", "lean", "other"


def lora_state(module: nn.Module) -> tuple[str, tuple[torch.Tensor, torch.Tensor] | None]:
    """How a (possibly peft-wrapped) linear's adapter contributes to its forward right now:
    ``(NONE, None)``: nothing (a plain linear, adapters disabled, none active here);
    ``(LEAN, (A (r, K), scaling * B (N, r)))``: one plain LoRA adapter;
    ``(OTHER, None)``: anything else (training mode, merged, DoRA and other variants, a bias on B,
    several adapters, someone else's instance forward): leave it to peft."""
    if not (hasattr(module, "lora_A") and hasattr(module, "base_layer")):
        return (NONE, None) if isinstance(module, nn.Linear) else (OTHER, None)
    if module.training or getattr(module, "merged", False) or "forward" in vars(module):
        return OTHER, None
    if module.disable_adapters or not any(a in module.lora_A for a in module.active_adapters):
        return NONE, None
    name = plain_adapter(module)
    if name is None:
        return OTHER, None
    A, sB = scaled_adapter(module, name)
    return LEAN, (A.detach(), sB.detach())


# ---------------------------------------------------------------------------- lean LoRA forward
def _lean_lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft's LoRA ``Linear.forward`` in two GEMMs for generation: ``base(x) + (x A^T) (s B)^T``, the
    scaling folded into a copy of B."""
    A, sB = self._qerl_lean                                       # (r, K), (N, r)
    return plus_lora(self.base_layer(x, *args, **kwargs), x, A, sB)


@contextlib.contextmanager
def lean_lora_forward(model: nn.Module, dtype: torch.dtype):
    """Within the block, every plain peft LoRA linear with one active adapter runs
    ``_lean_lora_forward`` on ``dtype`` copies of its A and (scaled) B: the adapter in the model's
    dtype, as vLLM runs it, and 2 kernels besides the base instead of peft's 4 (A, B, ``* scaling``,
    ``+``), ~400 fewer per decode step of a 28-layer model, which at batch 1 is launch-bound. Others
    (``lora_state`` not LEAN) keep peft's forward. The Parameters are never touched: swapping their
    ``.data`` for another dtype would reset their gradient accumulators and with them DDP's
    all-reduce hooks. Yields the number of linears patched."""
    patched = []
    for module in model.modules():
        if not hasattr(module, "lora_A"):
            continue
        state, weights = lora_state(module)
        if state != LEAN:
            continue
        A, sB = weights
        module._qerl_lean = (A.to(dtype), sB.to(dtype))
        module.forward = _lean_lora_forward.__get__(module)
        patched.append(module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward, module._qerl_lean


# ---------------------------------------------------------------------------- fused projections
def _one_buffer(parts: list[torch.Tensor], become_view) -> torch.Tensor:
    """``parts`` (same trailing shape and dtype) as the consecutive row blocks of one contiguous
    buffer, returned whole: found if they already are, else made by one concatenation after which
    ``become_view(i, view)`` re-points part i at its rows of the buffer."""
    first = parts[0]
    rows = sum(p.shape[0] for p in parts)
    storage, offset = first.untyped_storage(), first.storage_offset()
    position, in_place = offset, True
    for p in parts:
        in_place &= (p.is_contiguous() and p.untyped_storage().data_ptr() == storage.data_ptr()
                     and p.storage_offset() == position)
        position += p.numel()
    if in_place:
        return first.new_empty(0).set_(storage, offset, (rows, *first.shape[1:]))
    # The members keep pointing at this buffer after generation: built under an evaluation's
    # inference_mode it would be an inference tensor, and the next training forward could not save it.
    with torch.inference_mode(False), torch.no_grad():
        whole = torch.cat(parts)
    start = 0
    for i, p in enumerate(parts):
        become_view(i, whole[start: start + p.shape[0]])
        start += p.shape[0]
    return whole


def _row_starts_aligned(rows: list[int], row_bytes: int) -> bool:
    """Every part starts 16-byte aligned in the buffer (the CUDA kernels' vector loads need it)."""
    start = 0
    for n in rows:
        if (start * row_bytes) % 16:
            return False
        start += n
    return True


def _group_weight(bases: list[nn.Linear]) -> torch.Tensor | None:
    """The members' frozen weights as one ``[sum N, K]`` weight over shared storage, or None when
    they cannot be one (different K / dtype / device / NVFP4 per-tensor scale, a trainable or
    other quantized weight, misaligned row blocks)."""
    ws = [b.weight for b in bases]
    w0 = ws[0]
    if any(w.dim() != 2 or w.shape[1] != w0.shape[1] or w.device != w0.device or w.dtype != w0.dtype for w in ws):
        return None
    rows, K = [w.shape[0] for w in ws], w0.shape[1]
    if all(isinstance(w, NVFP4WeightTensor) for w in ws):
        if (any(not torch.equal(w.per_tensor_scale, w0.per_tensor_scale) for w in ws[1:])
                or not (_row_starts_aligned(rows, K // 2) and _row_starts_aligned(rows, K // 16))):
            return None
        qdata = _one_buffer([w.qdata for w in ws], lambda i, v: setattr(ws[i], "qdata", v))
        scale = _one_buffer([w.scale for w in ws], lambda i, v: setattr(ws[i], "scale", v))
        return NVFP4WeightTensor(qdata, scale, w0.per_tensor_scale, w0.orig_dtype)
    if all(type(w) is nn.Parameter and not w.requires_grad and w.is_floating_point() for w in ws):
        if not _row_starts_aligned(rows, K * w0.element_size()):
            return None
        return _one_buffer([w.detach() for w in ws], lambda i, v: setattr(ws[i], "data", v))
    return None


class _FusedGroup:
    """One launch for members that read the same input; each member takes its column slice."""

    def __init__(self, weight, bias, lora, sizes: list[int]):
        self.weight, self.bias, self.lora, self.sizes = weight, bias, lora, sizes
        self._x = self._outs = None
        self._left: set[int] = set()

    def output(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if self._x is not x or i not in self._left:
            y = F.linear(x, self.weight, self.bias)                  # (..., N_total): one kernel launch
            if self.lora is not None:                                # (R, K), (N_total, R) block-diagonal:
                y = plus_lora(y, x, *self.lora)                      # one GEMM for all A's, one for all B's
            self._x, self._outs, self._left = x, y.split(self.sizes, dim=-1), set(range(len(self.sizes)))
        out = self._outs[i]
        self._left.discard(i)
        if not self._left:                                           # every member served: hold nothing
            self._x = self._outs = None
        return out


def _member_forward(module: nn.Module, group: _FusedGroup, i: int):
    def forward(x, *args, **kwargs):
        if args or kwargs:
            return type(module).forward(module, x, *args, **kwargs)
        return group.output(x, i)
    return forward


def _group_bias(bases: list[nn.Linear], weight: torch.Tensor) -> torch.Tensor | None:
    """The members' biases concatenated in the weight's dtype (zeros for a member without one), or None."""
    if all(b.bias is None for b in bases):
        return None
    return torch.cat([b.bias.detach().to(weight.dtype) if b.bias is not None
                      else torch.zeros(b.out_features, dtype=weight.dtype, device=weight.device) for b in bases])


def _fuse(members: list[nn.Module], lora_dtype: torch.dtype | None) -> _FusedGroup | None:
    states = [lora_state(m) for m in members]
    if any(s == OTHER or (s == LEAN and lora_dtype is None) for s, _ in states):
        return None
    bases = [m.base_layer if hasattr(m, "base_layer") else m for m in members]
    if any(type(b) is not nn.Linear for b in bases):       # bitsandbytes & co. subclass nn.Linear
        return None
    weight = _group_weight(bases)
    if weight is None:
        return None
    sizes = [b.out_features for b in bases]
    bias = _group_bias(bases, weight)
    adapters = [(i, w) for i, (s, w) in enumerate(states) if s == LEAN]
    lora = None
    if adapters:
        A = torch.cat([a.to(lora_dtype) for _, (a, _) in adapters])          # (R, K)
        sB = torch.zeros(sum(sizes), A.shape[0], dtype=lora_dtype, device=A.device)
        col = 0
        for i, (a, b) in adapters:
            row = sum(sizes[:i])
            sB[row: row + sizes[i], col: col + a.shape[0]] = b.to(lora_dtype)
            col += a.shape[0]
        lora = (A, sB)
    return _FusedGroup(weight, bias, lora, sizes)


@contextlib.contextmanager
def _grouped(model: nn.Module, fuse):
    """Within the block, each q/k/v and gate/up group of ``model`` for which ``fuse(members)`` gives
    ``(modules, group)`` has module i serve its slice of the group's output. Yields the number of groups."""
    patched, groups = [], 0
    try:
        with torch.no_grad():
            for parent in model.modules():
                for names in GROUPS:
                    members = [getattr(parent, n, None) for n in names]
                    fused = fuse(members) if all(isinstance(m, nn.Module) for m in members) else None
                    if fused is None:
                        continue
                    modules, group = fused
                    for i, m in enumerate(modules):
                        m.forward = _member_forward(m, group, i)
                        patched.append(m)
                    groups += 1
        yield groups
    finally:
        for m in patched:
            del m.forward


def fused_projections(model: nn.Module, lora_dtype: torch.dtype | None):
    """Within the block, each q/k/v and gate/up group of ``model`` runs as one linear (see the
    module docstring). ``lora_dtype``: the dtype its adapters run in (the model's: as
    ``lean_lora_forward``); None leaves groups with an active adapter to peft. Groups that cannot be
    fused (``_group_weight``, ``lora_state`` OTHER, an instance forward already set) keep their
    forwards. Yields the number of groups fused."""
    def fuse(members):
        if any("forward" in vars(m) for m in members):
            return None
        group = _fuse(members, lora_dtype)
        return None if group is None else (members, group)
    return _grouped(model, fuse)


def fused_base_projections(model: nn.Module):
    """Within the block, the frozen NVFP4 bases of each q/k/v and gate/up group run as one linear,
    with autograd (for training passes); the adapters stay peft's (or ``qerl.lora_forward``'s), which
    call ``base_layer(x)`` and add their part. Forward, checkpoint recompute and backward each make
    one NVFP4 launch (a dequantize + GEMM at training sizes) per group instead of one per member: 4
    instead of 7 per decoder layer, which matters where the update is bound by the host's time per
    launch. On the H200 (``benchmarks/train_step.py --fused-projections off,on --rounds 6``,
    results/train_step_fused_projections_*_h200.json) the NVFP4 update of the Qwen2.5-0.5B shape
    took 0.91x of its time without (paired median); at the 7B shape, which is closer to GPU-bound,
    0.95x and 1.04x in two runs, i.e. no change within the noise. 16-bit bases are left alone:
    fused, the bf16 7B update took 1.13x (one GEMM over the concatenated weight and the
    concatenation of the members' gradients cost more than the launches saved).
    A member's bias that trains and anything ``_group_weight`` refuses keep their own forward.
    Yields the number of groups fused."""
    def fuse(members):
        bases = [m.base_layer if hasattr(m, "base_layer") else m for m in members]
        if any(type(b) is not nn.Linear or "forward" in vars(b) or not isinstance(b.weight, NVFP4WeightTensor)
               or (b.bias is not None and b.bias.requires_grad) for b in bases):
            return None
        weight = _group_weight(bases)
        if weight is None:
            return None
        return bases, _FusedGroup(weight, _group_bias(bases, weight), None, [b.out_features for b in bases])
    return _grouped(model, fuse)
