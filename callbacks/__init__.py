"""Lightning callbacks: rollout generation/scoring, adaptive quantization noise, the weight-bytes summary."""

from callbacks.aqn import AQNCallback
from callbacks.rollout import RolloutCallback
from callbacks.summary import WeightBytesSummary

__all__ = ["AQNCallback", "RolloutCallback", "WeightBytesSummary"]
