"""The embedded engine's two decoders and the attention it decodes with (``qerl.rollout.hf``).

``_DynamicDecoder``: HF's growing KV cache, one eager forward per token (any device, any attention
implementation). ``_StaticDecoder`` (CUDA): a ``StaticCache`` with one slot per prompt + new token and
explicit 4-D masks, so every decode step has the same shapes and addresses; the one-token step is
captured once per chunk as a CUDA graph and replayed. ``packed_gqa_decode_attention``: single-token
sdpa steps without copying K/V per query head.
"""

from __future__ import annotations

import contextlib
import inspect
import logging

import torch
import torch.nn.functional as F

from qerl.attention_masks import model_mask, padded_causal_mask
from qerl.cuda_graphs import abandon_capture

log = logging.getLogger("qerl.rollout.hf")  # (the engine's logger: its warnings read as the engine's)


def cache_keyword(model) -> str:
    """The forward keyword of the KV cache: ``cache`` since transformers 5.2x (which deprecates the old
    name and drops it in 5.40), ``past_key_values`` before (the GPU image's 5.17 knows only that)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft forwards **kwargs
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def returned_cache(out):
    """The KV cache of a forward's output, under either name (see :func:`cache_keyword`)."""
    return out["cache"] if "cache" in out else out.past_key_values


class _DynamicDecoder:
    """HF's dynamic KV cache: prefill, then one eager forward per token."""

    def __init__(self, model, ids, mask, positions):
        self.model, self.mask, self.positions, self.cache_kw = model, mask, positions, cache_keyword(model)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        self.cache, self.logits = returned_cache(out), out.logits[:, -1]  # (B, V)

    def step(self, nxt: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], 1)
        self.positions = self.positions[:, -1:] + 1
        out = self.model(input_ids=nxt[:, None], attention_mask=self.mask, position_ids=self.positions,
                         use_cache=True, **{self.cache_kw: self.cache})
        self.cache = returned_cache(out)
        return out.logits[:, -1]


class _StaticDecoder:
    """Static KV cache of ``P + max_new`` slots and explicit 4-D masks: every decode step has the same
    shapes and buffers, so with ``graph`` it is captured as a CUDA graph on the first step and replayed.

    Slot j of row b may be attended when it holds a real token (prompt non-pad, or generated) and
    j <= the query's slot; a left-pad query also sees itself (``qerl.attention_masks``: a fully masked
    row gives backend-dependent values).
    """

    def __init__(self, model, ids, mask, positions, max_new_tokens: int, graph: bool):
        from transformers import StaticCache

        B, P = ids.shape
        L = P + max_new_tokens
        dev = ids.device
        self.model, self.slot, self.cache_kw = model, P, cache_keyword(model)
        self.use_graph, self._warmed, self.graph = graph, False, None  # graph: captured on the second step
        config = model.config
        self.cache = StaticCache(config=config, max_cache_len=L)
        valid = torch.zeros(B, L, dtype=torch.bool, device=dev)  # slots that hold real tokens
        valid[:, :P] = mask.bool()
        sees = padded_causal_mask(valid, queries=P)  # (B, 1, P, L)
        self.dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
        self.eager = getattr(config, "_attn_implementation", "sdpa") == "eager"  # additive float masks
        out = model(input_ids=ids, attention_mask=self._mask(sees), position_ids=positions,
                    use_cache=True, logits_to_keep=1, **{self.cache_kw: self.cache})
        self.logits = out.logits[:, -1]  # (B, V)
        # the static inputs of the decode step, updated in place
        self.tok = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.pos = positions[:, -1:].clone()  # (B, 1)
        self.step_mask = self._mask(valid[:, None, None, :].clone())  # (B, 1, 1, L)
        self._open = 0.0 if self.eager else True

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        return model_mask(allowed, self.eager, self.dtype)

    def _forward(self) -> torch.Tensor:
        return self.model(input_ids=self.tok, attention_mask=self.step_mask, position_ids=self.pos,
                          use_cache=True, **{self.cache_kw: self.cache}).logits[:, -1]

    def step(self, nxt: torch.Tensor) -> torch.Tensor:
        self.tok.copy_(nxt[:, None])
        self.pos.add_(1)
        self.step_mask[:, :, :, self.slot] = self._open  # the new token's slot (the cache writes it there)
        self.slot += 1
        if not self.use_graph:
            return self._forward()
        if not self._warmed:
            # first step eager on a side stream (autotuning, cuBLAS workspaces, lazy buffers), then
            # capture the next; the cache advances its own write position inside the graph
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = self._forward()
            torch.cuda.current_stream().wait_stream(side)
            self._warmed = True
            return logits
        if self.graph is None:
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
            try:
                with torch.cuda.graph(graph):
                    self.graph_logits = self._forward()
            except Exception as err:  # a module that cannot be captured: keep the static cache, run eagerly
                # (nothing ran during the failed capture, so the cache's write position is unchanged)
                abandon_capture(graph, stream)
                log.warning("CUDA-graph capture of the decode step failed (%s: %s); decoding eagerly. "
                            "Set RolloutCallback(cuda_graphs=False) to skip the attempt.", type(err).__name__, err)
                self.use_graph = False
                torch.cuda.synchronize()
                return self._forward()
            self.graph = graph
        self.graph.replay()
        return self.graph_logits


def _packed_gqa_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """SDPA for one query token under grouped-query attention without materialising K/V per query head.

    transformers' sdpa path repeats every K/V head ``num_key_value_groups`` times whenever a mask is
    given (older releases, e.g. 5.17, at every step): with the engine's static cache that is a copy
    of the whole cache per layer and step (7B, batch 64, 512 slots: 2 x 117 MB per layer, ~8 ms of a
    ~40 ms step on the H200, ``benchmarks/profile_hf_decode.py --static``). With one query token the
    G query heads that share a K/V head can instead be G query *positions* of that head (the mask,
    the same for all heads, broadcasts over them): the same softmax per head, no copy."""
    groups = getattr(module, "num_key_value_groups", 1)
    B, H, T, D = query.shape
    shared_mask = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)
    if (T != 1 or groups == 1 or not shared_mask or key.shape[1] * groups != H
            or any(kwargs.get(k) is not None for k in ("position_bias", "softcap"))):
        return _STOCK_SDPA(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    q = query.reshape(B, H // groups, groups, D)  # (B, Hkv, G, D): heads h*G .. h*G+G-1 read K/V head h
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
    return out.reshape(B, H, 1, value.shape[-1]).transpose(1, 2).contiguous(), None  # (B, 1, H, Dv)


_STOCK_SDPA = None


@contextlib.contextmanager
def packed_gqa_decode_attention():
    """Within the block, the ``sdpa`` attention of every transformers model runs
    ``_packed_gqa_sdpa`` for single-token steps (anything else: transformers' own function)."""
    global _STOCK_SDPA
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    previous = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if previous is _packed_gqa_sdpa:  # already inside one
        yield
        return
    _STOCK_SDPA = previous
    ALL_ATTENTION_FUNCTIONS["sdpa"] = _packed_gqa_sdpa
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = previous
