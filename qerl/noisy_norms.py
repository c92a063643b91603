"""Noisy RMSNorm scales: the half of AQN that touches the model (the controllers are in ``qerl.aqn``).

:func:`attach_noisy_norms` wraps the norms, matched by module *name* (the released QeRL code's
isinstance test never matches vLLM's norms), and applies channel-wise noise Z ~ N(0, sigma^2) in fp32
inside the forward: (w + Z) * x / sqrt(mean(x^2) + eps). The weight is never modified (bf16 rounds
away sigma < ~4e-3 near 1; in-place adds accumulate). One draw per optimizer step from a CPU
generator seeded by (seed, step), so a resumed run, another device or another sigma draws the same
standard normals.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
from collections.abc import Iterator, Sequence

import torch
from torch import nn

_WRAPPER_SUFFIX = re.compile(r"(\.original_module|\.modules_to_save\.[^.]+|\.base_layer)$")


def noise_seed(seed: int, step: int) -> int:
    """The generator seed of one (run seed, optimizer step) pair."""
    return (int(seed) * 1_000_003 + int(step)) % (2**63)


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Round fp32 ``x`` to one of its two bf16 neighbours, the upper with probability equal to the
    fractional distance (unbiased: E[result] = x); returned as fp32 holding bf16 values. bf16 is the
    top half of the fp32 bit pattern, so adding a uniform 16-bit integer to the bits and truncating
    does it (sign-magnitude: it rounds |x| the same way for either sign)."""
    bits = x.detach().to(torch.float32).contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, generator=generator, dtype=torch.int32, device=generator.device)
    return ((bits + noise.to(bits.device)) & -65536).view(torch.float32)  # -65536 == 0xFFFF0000


def _eps(module: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps"):
        value = getattr(module, attr, None)
        if isinstance(value, float):
            return value
    return None


def _rmsnorm(module: nn.Module, hidden_states: torch.Tensor, noise: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm with scale ``weight.float() + noise`` applied in fp32, cast back once at the end.

    The normalised input is rounded to the input dtype first, as HF's norm does before its
    ``weight * h``: the product of two bf16 numbers is exact in fp32, so with zero noise this is
    bit-identical to HF's bf16 output, and a small sigma changes the outputs by the noise only,
    not by a different rounding path."""
    input_dtype = hidden_states.dtype
    h = hidden_states.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = (h * torch.rsqrt(variance + eps)).to(input_dtype).float()
    out = h * (module.weight.float() + noise.to(h.device))
    return out.to(torch.promote_types(module.weight.dtype, input_dtype))


class _NoisyForward:
    """Instance-level ``forward`` of a wrapped norm: the original forward while noise is off."""

    def __init__(self, module: nn.Module, original) -> None:
        self.module, self.original = module, original  # original: an instance-level forward or None

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs):
        m = self.module
        if not m.aqn_active:
            if self.original is not None:
                return self.original(hidden_states, *args, **kwargs)
            return type(m).forward(m, hidden_states, *args, **kwargs)
        if args or kwargs:
            raise TypeError("a noisy norm takes only hidden_states")
        return _rmsnorm(m, hidden_states, m.aqn_noise, m.aqn_eps)


def rms_norm_mismatch(module: nn.Module) -> str | None:
    """Why ``module`` is not an HF-style RMSNorm -- a 1-D weight, an eps, no bias, and its forward
    equal to ``_rmsnorm`` on a random input (skipped on the meta device) -- or None if it is one.
    The noisy norms and the engine's fused norm (``qerl.fused_ops``) replace the forward
    by that formula, so a norm that computes anything else (Gemma's ``1 + weight``) must not pass."""
    eps, weight = _eps(module), getattr(module, "weight", None)
    if eps is None or not isinstance(weight, torch.Tensor) or weight.dim() != 1 or getattr(module, "bias", None) is not None:
        return "is not an RMSNorm with a 1-D weight and an eps"
    if weight.device.type == "meta":
        return None
    # probed on a copy with scales away from 1 (a fresh norm's ones hide rounding differences), with
    # inputs in the weight's dtype and, for fp32 (trained) scales, in the bf16 of the activations
    probe = copy.deepcopy(module)
    probe.aqn_active = False  # a noisy norm (fused_ops asks while noise is on) is probed without its noise
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.rand(weight.shape, generator=g) + 0.5)
        zero = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for dtype in {weight.dtype, torch.bfloat16 if weight.dtype == torch.float32 else weight.dtype}:
            x = torch.randn(3, weight.shape[0], generator=g).to(device=weight.device, dtype=dtype)
            got, formula = probe(x), _rmsnorm(probe, x, zero, eps)
            if torch.equal(got, formula.to(got.dtype)):
                continue
            if torch.allclose(got.float(), _rmsnorm(probe, x, torch.ones_like(zero), eps).float(), rtol=1e-2, atol=1e-2):
                return "computes (1 + weight) * x * rsqrt(mean(x^2) + eps) (a Gemma-style norm), not weight * ..."
            if torch.allclose(got.float(), formula.float(), rtol=1e-2, atol=1e-2):  # e.g. OLMo2: w * x in fp32, then cast
                return ("rounds differently from weight * x.to(dtype) * rsqrt(...) (it is not bit-identical to "
                        "the formula the noisy and fused norms compute)")
            return "does not compute weight * x * rsqrt(mean(x^2) + eps)"
    return None


def _check_plain_rms_norm(module: nn.Module, name: str) -> None:
    reason = rms_norm_mismatch(module)
    if reason is not None:
        raise ValueError(f"{name} ({type(module).__name__}) {reason}: AQN's noisy norms replace its forward by HF's "
                         "plain RMSNorm, weight * x * rsqrt(mean(x^2) + eps); leave AQN out for this model")


def _is_wrapped(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), _NoisyForward)


def _wrap(module: nn.Module) -> None:
    """Give a checked norm (:func:`_check_plain_rms_norm`) its noisy forward, noise off."""
    if _is_wrapped(module):
        return  # already wrapped (e.g. a deepcopy of a wrapped model): adopt it
    module.aqn_eps = _eps(module)
    module.aqn_noise = torch.zeros(module.weight.shape, dtype=torch.float32, device=module.weight.device)
    module.aqn_active = False
    module.forward = _NoisyForward(module, module.__dict__.get("forward"))


class NoisyNorms:
    """Handle on the noisy norms of one model (made by :func:`attach_noisy_norms`).

    ``names`` are the matched module names with peft wrapper suffixes stripped (a peft
    ``modules_to_save`` norm's original and trainable copies share one name and one noise vector).
    """

    def __init__(self, targets: dict[str, tuple[nn.Module, list[nn.Module]]]) -> None:
        self._targets = targets  # name -> (module at that name, wrapped leaf norms)
        self.names: list[str] = list(targets)
        self.sigma, self.seed, self.step = 0.0, 0, -1
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        """False inside :meth:`disable` (reference/KL pass, evaluation)."""
        return self._enabled

    @property
    def active(self) -> bool:
        """True when the forward adds noise now."""
        return self._enabled and self.sigma > 0

    def _sync(self) -> None:
        for _, leaves in self._targets.values():
            for leaf in leaves:
                leaf.aqn_active = self.active

    @torch.no_grad()
    def set_noise(self, sigma: float, seed: int, step: int, scale_precision: str = "fp32") -> None:
        """Draw Z ~ N(0, sigma^2) for every noisy norm, from a CPU generator seeded by (seed, step).

        The standard normal draws depend only on (seed, step), so a resumed run, another device or
        another sigma gets the same (scaled) noise; sigma = 0 turns the noise off exactly.
        ``scale_precision="bf16"``: the noisy scale w + Z is stochastically rounded to bf16 (unbiased,
        same generator), so an engine that keeps norms in bf16 (vLLM) runs exactly the trainer's
        noisy model instead of one where round-to-nearest erased noise below half a bf16 step.
        The mean is kept, but well below one bf16 step (Δ, 2^-8..2^-7 near 1) the noise becomes
        sparse: a channel moves by Δ with probability ~|Z|/Δ, so its std is ~sqrt(0.8 sigma Δ)
        (about 1.5e-3 for sigma = 5e-4 near 1) rather than sigma.
        """
        if scale_precision not in ("fp32", "bf16"):
            raise ValueError(f"scale_precision must be 'fp32' or 'bf16', not {scale_precision!r}")
        if not (math.isfinite(sigma) and sigma >= 0):  # a custom controller's -0.01 would silently mean no noise
            raise ValueError(f"AQN sigma must be >= 0 and finite, got {sigma} at step {step}")
        self.sigma, self.seed, self.step = float(sigma), int(seed), int(step)
        gen = torch.Generator().manual_seed(noise_seed(seed, step))
        for top, leaves in self._targets.values():
            z = torch.randn(leaves[0].weight.shape, generator=gen, dtype=torch.float32) * self.sigma
            if scale_precision == "bf16" and self.sigma > 0:
                w = top.weight.detach().float().cpu()
                # w + z lands on a bf16 value (what vLLM's bf16 copy holds); z is exact in fp32 when w is
                # a bf16 value too, and a trained fp32 norm (trainable_norms) keeps its own low bits
                z = stochastic_round_bf16(w + z, gen) - w
            for leaf in leaves:
                if leaf.aqn_noise.device != leaf.weight.device:
                    leaf.aqn_noise = torch.zeros_like(z, device=leaf.weight.device)
                leaf.aqn_noise.copy_(z)  # in place: keeps the tensor identity torch.compile saw
        self._sync()

    @contextlib.contextmanager
    def enabled(self, flag: bool = True) -> Iterator[NoisyNorms]:
        """Context with the noise turned on (``flag``) or off; restores the previous setting."""
        previous, self._enabled = self._enabled, bool(flag)
        self._sync()
        try:
            yield self
        finally:
            self._enabled = previous
            self._sync()

    def disable(self) -> contextlib.AbstractContextManager[NoisyNorms]:
        """Context with the noise off (the clean policy), e.g. ``with norms.disable(): ...``."""
        return self.enabled(False)

    @torch.no_grad()
    def effective_scales(self) -> dict[str, torch.Tensor]:
        """fp32 ``weight + Z`` of each noisy norm as applied in the forward now (plain weight when off).

        Uses the weight the module at that name currently runs (peft: the active adapter's copy).
        """
        out = {}
        for name, (top, leaves) in self._targets.items():
            w = top.weight.detach().float()
            out[name] = w + leaves[0].aqn_noise.to(w.device) if self.active else w.clone()
        return out

    @torch.no_grad()
    def fraction_changed(self) -> float:
        """Fraction of noisy-norm channels whose applied fp32 scale differs from the plain weight."""
        changed = total = 0
        for name, scale in self.effective_scales().items():
            w = self._targets[name][0].weight.detach().float()
            changed += int((scale != w).sum())
            total += w.numel()
        return changed / max(total, 1)

    def remove(self) -> None:
        """Unwrap every norm (restores the original forwards; the handle is dead afterwards)."""
        for _, leaves in self._targets.values():
            for leaf in leaves:
                fwd = leaf.__dict__.pop("forward")
                if fwd.original is not None:
                    leaf.forward = fwd.original
                for attr in ("aqn_eps", "aqn_noise", "aqn_active"):
                    leaf.__dict__.pop(attr, None)
        self._targets, self.names = {}, []


def attach_noisy_norms(model: nn.Module,
                       module_names: Sequence[str] = ("input_layernorm", "post_attention_layernorm")) -> NoisyNorms:
    """Wrap every norm whose qualified name ends with one of ``module_names`` (by name, any class).

    Works on plain HF models and peft-wrapped ones. The norms' parameters, buffers and state_dict
    keys are unchanged, and noise starts off (sigma = 0). Raises if nothing matches.
    """
    modules = dict(model.named_modules())
    matched: list[tuple[str, str]] = []  # (name without peft wrapper suffixes, qualified name of the leaf)
    for qname, module in modules.items():
        if "weight" not in module._parameters:
            continue
        name = qname
        while _WRAPPER_SUFFIX.search(name):
            name = _WRAPPER_SUFFIX.sub("", name)
        if any(name == n or name.endswith("." + n) for n in module_names):
            matched.append((name, qname))
    if not matched:
        raise ValueError(f"no module name ends with any of {list(module_names)}")
    post_norms = [n for n, _ in matched if n.endswith("post_attention_layernorm")  # (a peft wrapper keeps the name)
                  and n.rpartition(".")[0] + ".post_feedforward_layernorm" in modules]
    if post_norms:  # OLMo2, Gemma2/3: normalises the attention's output before the residual add
        raise ValueError(f"{post_norms[0]} is a post-norm here (its layer also has a post_feedforward_layernorm): it "
                         "scales the attention output, not the MLP's input, so AQN noise there is not the paper's "
                         "noise on the frozen weights, and these layers have no plain norm before q/k/v and gate/up: "
                         "leave AQN out for this architecture")
    for _, qname in matched:  # every norm checked before any is wrapped
        if not _is_wrapped(modules[qname]):
            _check_plain_rms_norm(modules[qname], qname)
    targets: dict[str, tuple[nn.Module, list[nn.Module]]] = {}
    for name, qname in matched:
        _wrap(modules[qname])
        targets.setdefault(name, (modules[name], []))[1].append(modules[qname])
    return NoisyNorms(targets)
