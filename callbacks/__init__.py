"""Lightning callbacks: rollout generation/scoring and adaptive quantization noise."""

from callbacks.aqn import AQNCallback
from callbacks.rollout import RolloutCallback

__all__ = ["AQNCallback", "RolloutCallback"]
