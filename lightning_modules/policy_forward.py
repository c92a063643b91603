"""How ``QeRLModule``'s training passes run the policy: the completion log-probs of a
``[left-padded prompt | right-padded completion]`` batch, cut to its rows' own extent, and the
contexts every training forward runs in (AQN noise with ``apply_to``, the fused Triton ops on CUDA).
The training step itself (``lightning_modules/qerl_module.py``) reads the surrogate off these."""

from __future__ import annotations

import contextlib

import torch

from qerl.attention_masks import left_padding_mask
from qerl.logprobs import entropy_from_logits, selective_log_softmax
from qerl.rollout.fast_linears import fused_base_projections


def forward_window(attention_mask: torch.Tensor, prompt_len: int) -> tuple[int, int]:
    """``(start, stop)``: the columns of ``[left-padded prompt | right-padded completion]`` rows that
    a forward needs -- from the first column some row uses (at most ``prompt_len - 1``: the logit of
    the first completion token) to past the last one (at least one completion column)."""
    used = attention_mask.any(0).nonzero()                                   # (k, 1) columns some row uses
    start = min(int(used[0]) if used.numel() else prompt_len - 1, prompt_len - 1)
    stop = max(int(used[-1]) + 1 if used.numel() else 0, prompt_len + 1)
    return start, stop


class PolicyForwardMixin:
    """The policy's training forwards (expects ``model``, ``noisy_norms``, ``aqn_apply_to``,
    ``fused_ops`` and ``device`` from the module)."""

    def _training_noise(self):
        """AQN in training forwards: on with ``apply_to: both``, off with ``rollout`` (then TIS corrects)."""
        if self.noisy_norms is not None and self.aqn_apply_to == "rollout":
            return self.noisy_norms.disable()
        return contextlib.nullcontext()

    def completion_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_ids: torch.Tensor,
        temperature: float, with_entropy: bool = False, entropy_grad: bool = False, cut: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropies) of the completion tokens under log softmax(logits / T).

        input_ids = [left-padded prompt | right-padded completion], (n, P+T); returns (n, T): 0 past
        the micro-batch's longest completion, the padding token's log-prob at a shorter row's padding
        (every consumer masks it). The forward runs on these rows' own extent only: the columns where
        every row is padding (left of the longest prompt, right of the longest completion) are cut,
        which changes no position (they count from the first real token) and no attention (padding
        is masked); ``cut=False`` runs the full width (``benchmarks/micro_batching.py``'s baseline).
        The last column is not fed either: its logit would predict past the completion (causal
        attention: nothing else changes), and the kept logits come out contiguous, so the log-softmax
        copies none of the (n, T, V) tensor. The entropy is detached unless ``entropy_grad``."""
        T = completion_ids.shape[1]
        P = input_ids.shape[1] - T
        start, stop = forward_window(attention_mask, P) if cut else (0, P + T)
        T_used = stop - P
        stop_in = stop - 1 if T_used > 0 else stop  # (no completion token at all: one dummy logit, unused)
        input_ids, attention_mask = input_ids[:, start:stop_in], attention_mask[:, start:stop_in]
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # same rule as the HF engine
        # left padding: each padding query sees itself (cuDNN attention's backward can give NaN for a
        # query row that sees nothing, and 0 * NaN reaches every LoRA gradient: qerl.attention_masks)
        out = self.model(input_ids=input_ids, attention_mask=left_padding_mask(self.model, attention_mask),
                         position_ids=position_ids, use_cache=False, logits_to_keep=max(T_used, 1))
        logits = out.logits[:, :T_used]  # (n, T_used, V), the model's dtype: the temperature divides in fp32 below
        tau = temperature if temperature > 0 else 1.0
        pad = lambda values: torch.nn.functional.pad(values, (0, T - T_used))  # noqa: E731  (n, T_used) -> (n, T)
        logprobs = pad(selective_log_softmax(logits, completion_ids[:, :T_used], temperature=tau))  # (n, T) fp32
        entropy = None
        if with_entropy or entropy_grad:
            entropy = pad(entropy_from_logits(logits if entropy_grad else logits.detach(), temperature=tau))  # (n, T)
        return logprobs, entropy

    def _fused_ops(self):
        """``qerl.fused_ops`` and ``fused_base_projections`` on CUDA when enabled (forward, checkpoint
        recompute and backward inside)."""
        if not (self.fused_ops and self.device.type == "cuda"):
            return contextlib.nullcontext()
        from qerl.fused_ops import fused_ops  # Triton: imported only where it runs

        stack = contextlib.ExitStack()
        stack.enter_context(fused_ops(self.model))
        stack.enter_context(fused_base_projections(self.model))
        return stack
