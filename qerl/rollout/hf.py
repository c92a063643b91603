"""The embedded rollout engine: generates with the training model itself (works on CPU).

A plain sampling loop over the HF forward with a KV cache, written out rather than calling
``generate()`` so that (1) the sampler log-probs are exactly log softmax(logits / T) of the same
forward the trainer uses, (2) sampling is seeded by a ``torch.Generator`` (reproducible, and
independent of the global RNG), and (3) position ids of left-padded prompts match the trainer's.
Whatever the model carries (LoRA, AQN noisy norms, NVFP4 kernels) is what generates.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F

from qerl.rollout.base import Generation, RolloutEngine, SamplingSettings, pad_left


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and outside the smallest set of mass >= top_p."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


# transformers >= 5.2x renames `past_key_values` to `cache`; the GPU image (5.17) only has the old name.
warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated.*")


class HFEngine(RolloutEngine):
    """Samples from the training model in place.

    Args:
        stop_token_ids: token ids that end a completion (EOS, ``<|im_end|>``...).
        pad_token_id: id fed for finished rows and used to pad prompts.
        max_batch_size: sequences decoded together; larger prompt sets are done in chunks.
    """

    def __init__(self, stop_token_ids: list[int], pad_token_id: int, max_batch_size: int = 64):
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.model: torch.nn.Module | None = None

    def sync(self, model: torch.nn.Module, norm_scales: dict[str, torch.Tensor] | None = None) -> None:
        # Same weights, same noisy norms: nothing to copy, just remember the model.
        self.model = model

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingSettings, seed: int) -> Generation:
        if self.model is None:
            raise RuntimeError("HFEngine.generate called before sync(model)")
        start = time.perf_counter()
        repeated = [p for p in prompt_ids for _ in range(n)]  # prompt-major: (B*n,)
        device = next(self.model.parameters()).device
        # Sample on the model's device (copying (B, V) probabilities to the host every token would
        # dominate decode time); CPU and CUDA runs are each reproducible, not equal to each other.
        gen = torch.Generator(device=device).manual_seed(seed)
        out = Generation([], [], [])
        was_training = self.model.training
        self.model.eval()
        try:
            for lo in range(0, len(repeated), self.max_batch_size):
                chunk = self._generate_chunk(repeated[lo: lo + self.max_batch_size], sampling, gen)
                out.completion_ids += chunk.completion_ids
                out.sampler_logprobs += chunk.sampler_logprobs
                out.finish_reasons += chunk.finish_reasons
        finally:
            self.model.train(was_training)
        out.timings["generate"] = time.perf_counter() - start
        return out

    def _generate_chunk(self, prompts: list[list[int]], sampling: SamplingSettings, gen: torch.Generator) -> Generation:
        device = gen.device  # the model's (see generate)
        ids, mask = pad_left(prompts, self.pad_token_id)
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P) — same rule as the trainer
        stop = torch.tensor(self.stop_token_ids, device=device)
        rows = ids.shape[0]
        tokens = torch.empty(rows, 0, dtype=torch.long, device=device)
        logprobs = torch.empty(rows, 0, dtype=torch.float32, device=device)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        lengths = torch.full((rows,), sampling.max_new_tokens, dtype=torch.long, device=device)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        for t in range(sampling.max_new_tokens):
            logits = out.logits[:, -1].float()  # (B, V)
            greedy = sampling.temperature <= 0
            scaled = logits if greedy else logits / sampling.temperature
            logp = F.log_softmax(scaled, dim=-1)
            if greedy:
                nxt = scaled.argmax(-1)
            else:
                probs = filter_logits(scaled, sampling.top_k, sampling.top_p).softmax(-1)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            nxt = torch.where(finished, torch.full_like(nxt, self.pad_token_id), nxt)
            tokens = torch.cat([tokens, nxt[:, None]], 1)
            logprobs = torch.cat([logprobs, logp.gather(-1, nxt[:, None])], 1)
            just_stopped = ~finished & torch.isin(nxt, stop)
            lengths = torch.where(just_stopped, torch.full_like(lengths, t + 1), lengths)
            finished |= just_stopped
            if bool(finished.all()) or t + 1 == sampling.max_new_tokens:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            positions = positions[:, -1:] + 1
            out = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=positions,
                             past_key_values=out.past_key_values, use_cache=True)
        result = Generation([], [], [])
        for i in range(rows):
            n_tok = int(lengths[i])
            result.completion_ids.append(tokens[i, :n_tok].tolist())
            result.sampler_logprobs.append(logprobs[i, :n_tok].tolist())
            result.finish_reasons.append("stop" if bool(finished[i]) else "length")
        return result
