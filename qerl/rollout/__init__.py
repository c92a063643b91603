"""Rollout engines: one interface (`RolloutEngine`), the embedded `hf` engine and (optional) `vllm`."""

from qerl.rollout.base import Generation, Rollout, RolloutEngine, SamplingSettings, pad_left, pad_right, stop_token_ids

__all__ = ["Generation", "Rollout", "RolloutEngine", "SamplingSettings", "pad_left", "pad_right", "stop_token_ids"]
