"""The embedded rollout engine: generates with the training model itself (works on CPU).

A plain sampling loop over the HF forward with a KV cache, written out rather than calling
``generate()`` so that (1) the sampler log-probs are exactly log softmax(logits / T) of the same
forward the trainer uses (renormalised over the kept set with top-k/top-p, as vLLM's), (2) every
completion draws its tokens from its own seeded uniforms (``sample_uniforms``: reproducible, independent
of the global RNG and of the other rows decoded beside it), and (3) position ids of left-padded prompts
match the trainer's.
Whatever the model carries (LoRA, AQN noisy norms, NVFP4 kernels) is what generates.

Two decoders share the loop (``qerl/rollout/decoders.py``). ``_DynamicDecoder``: HF's growing KV
cache, one eager forward per token (any device, any attention implementation). ``_StaticDecoder``
(CUDA, ``cuda_graphs=True``): a
``StaticCache`` with one slot per prompt + new token and explicit 4-D masks, so every decode step has
the same shapes and addresses; the one-token step is captured once per chunk as a CUDA graph and
replayed, which removes the per-kernel launch cost that dominates small-batch decode (hundreds of
small kernels per token at 7B). The graph is captured per ``generate`` chunk, after the AQN noise and
the adapter of the step are in place, so it always runs the current policy.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F

from qerl.attention_masks import sliding_window_below
from qerl.norms import base_model_only
from qerl.rollout.base import (Generation, NonFiniteLogits, RolloutEngine, SamplingSettings, pad_left, prompt_seeds,
                               sample_inverse_cdf, sample_uniforms, stop_token_ids)
from qerl.rollout.decoders import (  # noqa: F401 (cache_keyword, returned_cache, _packed_gqa_sdpa: re-exported)
    _DynamicDecoder, _packed_gqa_sdpa, _StaticDecoder, cache_keyword, packed_gqa_decode_attention, returned_cache)
from qerl.rollout.fast_linears import fused_projections, lean_lora_forward

ADAPTER_DTYPES = ("model", "stored")
# Whether every row has stopped is read on the host (a sync) only every this-many tokens, so the
# host queues the next steps while the GPU decodes; rows that stopped meanwhile decode padding,
# which is cut off (at most STOP_CHECK_EVERY - 1 extra steps per chunk, no change to any output).
STOP_CHECK_EVERY = 8

log = logging.getLogger(__name__)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Mask (to -inf) tokens less likely than ``min_p`` x the most likely one, then those outside the
    top-k, then those outside the smallest set of mass >= top_p (vLLM's order)."""
    if min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
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


def _fused_ops(model: torch.nn.Module):
    from qerl.fused_ops import fused_ops  # Triton: imported only where it runs

    return fused_ops(model)


def check_adapter_dtype(value: str, what: str) -> None:
    """A clear error for an ``adapter_dtype`` other than ``model`` / ``stored``."""
    if value not in ADAPTER_DTYPES:
        raise ValueError(f"{what} must be 'model' or 'stored', got {value!r}")


def decode_mode(device_type: str, cuda_graphs: bool, attn_implementation: str, static: bool | None = None,
                window_fits: bool = True) -> str:
    """``graph`` (static cache, CUDA graph), ``static`` (static cache, eager) or ``dynamic``.
    ``static=True`` forces the static cache (tests run it on the CPU), ``False`` the dynamic one;
    attention implementations that take no explicit 4-D mask (flash attention...) stay dynamic, and
    so do models with a sliding window shorter than prompt + completion (``window_fits=False``)."""
    graph = device_type == "cuda" and cuda_graphs
    if not (graph if static is None else static) or attn_implementation not in ("sdpa", "eager") or not window_fits:
        return "dynamic"
    return "graph" if graph else "static"


class HFEngine(RolloutEngine):
    """Samples from the training model in place.

    Args:
        stop_token_ids: token ids that end a completion (EOS, ``<|im_end|>``...).
        pad_token_id: id fed for finished rows and used to pad prompts.
        max_batch_size: sequences decoded together; larger prompt sets are done in chunks.
        cuda_graphs: on CUDA, decode with a static KV cache replayed as a CUDA graph (sdpa or eager
            attention); otherwise, and on CPU, one eager forward per token with HF's dynamic cache.
        adapter_dtype: ``model``: while generating, each adapted linear runs on copies of its LoRA
            weights in the model's activation dtype (bf16), as vLLM runs them, as two GEMMs
            (``lean_lora_forward``: scaling folded into B, the add fused); ``stored``: through the
            model's own (training) forward, as it is: with ``LoraSettings.compute_dtype: stored``
            that is peft's, which keeps trainable adapters in fp32 and casts every activation to
            fp32 and back around two fp32 GEMVs per adapted linear (60% of a 7B bf16 decode step's
            kernel time at batch 1, ``benchmarks/profile_hf_decode.py``); with ``compute_dtype:
            model`` (the default) the same ``plus_lora`` as ``model`` here, on casts made per call.
            So the sampler's log-probs equal the trainer's up to kernel rounding, except with
            ``compute_dtype: stored`` and ``model`` here: a bf16-sized gap that the trainer's
            importance-sampling correction sees (``train/is_ratio``).
        fused_ops: on CUDA, while generating, RMSNorm (with AQN noise), the rotary embedding and
            SiLU(gate) * up run as one Triton kernel each (``qerl.fused_ops``; the rotary
            embedding bit-identical to transformers', the others up to rare 1-ulp differences).
        fused_projections: on CUDA, while generating, q/k/v and gate/up run as one linear each over
            their concatenated weights (and one LoRA-A / one block-diagonal B GEMM), the shapes the
            NVFP4 kernels are tuned for (``qerl.rollout.fast_linears``; the members' weights become
            row-slice views of one buffer the first time, no copy is kept). Needs
            ``adapter_dtype="model"`` for adapted groups.
    """

    def __init__(self, stop_token_ids: list[int], pad_token_id: int, max_batch_size: int = 64,
                 cuda_graphs: bool = True, adapter_dtype: Literal["model", "stored"] = "model",
                 fused_ops: bool = True, fused_projections: bool = True):
        check_adapter_dtype(adapter_dtype, "HFEngine: adapter_dtype")
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.cuda_graphs = cuda_graphs
        self.adapter_dtype = adapter_dtype
        self.fused_ops = fused_ops
        self.fused_projections = fused_projections
        self.model: torch.nn.Module | None = None
        self.adapter = True

    @classmethod
    def for_model(cls, model: torch.nn.Module, tokenizer, max_batch_size: int = 64, cuda_graphs: bool = True,
                  adapter_dtype: Literal["model", "stored"] = "model", fused_ops: bool = True,
                  fused_projections: bool = True) -> "HFEngine":
        """The engine for a policy and its tokenizer: stops at the model's end-of-turn / EOS tokens."""
        return cls(stop_token_ids(tokenizer, model), tokenizer.pad_token_id, max_batch_size,
                   cuda_graphs=cuda_graphs, adapter_dtype=adapter_dtype, fused_ops=fused_ops,
                   fused_projections=fused_projections)

    def sync(self, model: torch.nn.Module, norm_scales: dict[str, torch.Tensor] | None = None,
             adapter: bool = True) -> None:
        # Same weights, same noisy norms: nothing to copy, just remember the model.
        self.model, self.adapter = model, adapter

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingSettings,
                 seed: int | Sequence[int]) -> Generation:
        if self.model is None:
            raise RuntimeError("HFEngine.generate called before sync(model)")
        empty = next((i for i, p in enumerate(prompt_ids) if len(p) == 0), None)
        if empty is not None:  # (as vLLM refuses one: nothing to condition on, and an all-empty batch has no shape)
            raise ValueError(f"HFEngine.generate: prompt {empty} has no tokens")
        start = time.perf_counter()
        repeated = [p for p in prompt_ids for _ in range(n)]  # prompt-major: (B*n,)
        seeds = prompt_seeds(seed, len(prompt_ids))
        # row r = sample r % n of prompt r // n; its uniforms are drawn per chunk (chunking and batch
        # composition change no row's draws; CPU and CUDA logits differ, so their samples may too)
        row_keys = [(seeds[r // n], r % n) for r in range(len(repeated))]
        out = Generation([], [], [])
        was_training = self.model.training
        self.model.eval()
        adapter_off = base_model_only(self.model) if not self.adapter else contextlib.nullcontext()
        lora_dtype = self.model.get_input_embeddings().weight.dtype if self.adapter_dtype == "model" else None
        cast = (lean_lora_forward(self.model, lora_dtype)
                if self.adapter and lora_dtype is not None else contextlib.nullcontext())
        on_cuda = next(self.model.parameters()).device.type == "cuda"
        grouped = fused_projections(self.model, lora_dtype) if self.fused_projections and on_cuda else contextlib.nullcontext()
        fused = _fused_ops(self.model) if self.fused_ops and on_cuda else contextlib.nullcontext()
        try:
            # order: the adapter switch first (the groups read it), the groups before the lean
            # forward (which leaves their members alone)
            with adapter_off, grouped, cast, fused:
                for lo in range(0, len(repeated), self.max_batch_size):
                    chunk = self._generate_chunk(repeated[lo: lo + self.max_batch_size], sampling,
                                                 row_keys[lo: lo + self.max_batch_size])
                    out.completion_ids += chunk.completion_ids
                    out.sampler_logprobs += chunk.sampler_logprobs
                    out.finish_reasons += chunk.finish_reasons
        finally:
            self.model.train(was_training)
        out.timings["generate"] = time.perf_counter() - start
        return out

    def _decoder(self, ids, mask, positions, sampling: SamplingSettings, static: bool | None = None):
        impl = getattr(self.model.config, "_attn_implementation", "sdpa")
        fits = not sliding_window_below(self.model.config, ids.shape[1] + sampling.max_new_tokens)
        mode = decode_mode(ids.device.type, self.cuda_graphs, impl, static, window_fits=fits)
        if mode == "dynamic":
            return _DynamicDecoder(self.model, ids, mask, positions)
        return _StaticDecoder(self.model, ids, mask, positions, sampling.max_new_tokens, graph=mode == "graph")

    def _generate_chunk(self, prompts: list[list[int]], sampling: SamplingSettings,
                        row_keys: list[tuple[int, int]], static: bool | None = None) -> Generation:
        device = next(self.model.parameters()).device  # sampling runs there: no (B, V) copy per token
        greedy = sampling.temperature <= 0
        uniforms = None if greedy else torch.stack(  # (B, max_new_tokens)
            [sample_uniforms(key, sample, sampling.max_new_tokens) for key, sample in row_keys]).to(device)
        ids, mask = pad_left(prompts, self.pad_token_id)
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P) — same rule as the trainer
        stop = torch.tensor(self.stop_token_ids, device=device)
        rows = ids.shape[0]
        tokens = torch.empty(rows, 0, dtype=torch.long, device=device)
        logprobs = torch.empty(rows, 0, dtype=torch.float32, device=device)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        lengths = torch.full((rows,), sampling.max_new_tokens, dtype=torch.long, device=device)
        non_finite = torch.zeros((), dtype=torch.bool, device=device)  # read with the stop check (no extra sync)
        with packed_gqa_decode_attention():
            decoder = self._decoder(ids, mask, positions, sampling, static)
            logits_bf = decoder.logits
            for t in range(sampling.max_new_tokens):
                logits = logits_bf.float()  # (B, V)
                if greedy:
                    logp = F.log_softmax(logits, dim=-1)
                    nxt = logits.argmax(-1)
                else:  # log-probs of the distribution sampled from: after min-p/top-k/top-p, renormalised (as vLLM's)
                    kept = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
                    logp = F.log_softmax(kept, dim=-1)
                    nxt = sample_inverse_cdf(logp.exp(), uniforms[:, t])
                nxt = torch.where(finished, torch.full_like(nxt, self.pad_token_id), nxt)
                tokens = torch.cat([tokens, nxt[:, None]], 1)
                # (B, 1); NaN when a row's logits hold NaN / +inf; -inf is fine only as a stopped row's
                # padding outside the top-p / top-k set (cut off below)
                picked = logp.gather(-1, nxt[:, None])
                non_finite |= (picked.isnan() | (picked.isinf() & ~finished[:, None])).any()
                logprobs = torch.cat([logprobs, picked], 1)
                just_stopped = ~finished & torch.isin(nxt, stop)
                lengths = torch.where(just_stopped, torch.full_like(lengths, t + 1), lengths)
                finished |= just_stopped
                last = t + 1 == sampling.max_new_tokens
                if last or (t + 1) % STOP_CHECK_EVERY == 0:
                    done = torch.stack([finished.all(), non_finite]).tolist()  # one sync
                    if done[1]:
                        raise NonFiniteLogits(f"non-finite logits within the first {t + 1} generated tokens: "
                                              "the policy's weights or the AQN noise hold NaN / inf, or overflow")
                    if last or done[0]:
                        break
                logits_bf = decoder.step(nxt)
        result = Generation([], [], [])
        for i in range(rows):
            n_tok = int(lengths[i])
            result.completion_ids.append(tokens[i, :n_tok].tolist())
            result.sampler_logprobs.append(logprobs[i, :n_tok].tolist())
            result.finish_reasons.append("stop" if bool(finished[i]) else "length")
        return result
