"""Format rewards: the answer's shape, not its value. ``FormatReward`` (exactly one closed, non-empty
``\\boxed{}``) and ``TagFormatReward`` (DeepSeek-R1-Zero's ``<think>``/``<answer>`` tags). Both are
plain ``RewardFunction`` s that never raise on any text; YAML configs name them as
``qerl.rewards.FormatReward`` / ``qerl.rewards.TagFormatReward`` (re-exported there) or by this module."""

from __future__ import annotations

import re
from typing import Any

from qerl.answers import _ZERO_WIDTH, _boxed_spans
from qerl.reward_function import RewardFunction

_WHITESPACE_RE = re.compile(r"\s*")


class FormatReward(RewardFunction):
    """1.0 if the completion contains exactly one closed, non-empty ``\\boxed{}``/``\\fbox{}``.

    Several boxes (hedging), an empty box or only an unclosed box give 0.0. Nested boxes count
    separately. Kept deliberately simple: no ``<think>`` tags, since our prompts ask only for a
    boxed final answer.

    Args:
        max_chars_after: If set, the box must also close within this many characters of the end
            (e.g. 200), which penalises answering early and then rambling on. None: anywhere.
    """

    name = "format"

    def __init__(self, max_chars_after: int | None = None) -> None:
        super().__init__()
        if max_chars_after is not None and not max_chars_after >= 0:  # (negative: every completion scored 0)
            raise ValueError(f"FormatReward: max_chars_after must be >= 0 or null, got {max_chars_after}")
        self.max_chars_after = max_chars_after

    def score_one(self, completion: Any) -> float:
        """Score one completion; never raises."""
        if not isinstance(completion, str):
            return 0.0
        spans = _boxed_spans(completion)
        if len(spans) != 1:
            return 0.0
        start, end = spans[0]
        if not completion[start:end].translate(_ZERO_WIDTH).strip():  # (a zero-width character is no answer)
            return 0.0
        if self.max_chars_after is not None and len(completion) - (end + 1) > self.max_chars_after:
            return 0.0
        return 1.0

    def compute(self, completions: list[str], answers: list[str]) -> list[float]:
        return [self.score_one(c) for c in completions]


class TagFormatReward(RewardFunction):
    """1.0 if the completion is ``<think>...</think>`` then ``<answer>...</answer>`` and nothing else
    (whitespace aside): DeepSeek-R1-Zero's format reward, for prompts that ask for those tags. Each
    tag exactly once, the answer not empty; linear time on any text.

    Args:
        think_opened_in_prompt: The prompt itself ends with ``<think>`` (R1-Zero's template, "...
            Assistant: <think>"), so the completion starts inside the thought, without that tag.
        strict: False: 1.0 if the completion *contains* ``<think>...</think>``, whitespace,
            ``<answer>...</answer>`` anywhere (the official QeRL code's ``soft_format_reward``,
            its regex ``<think>.*?</think>\\s*<answer>.*?</answer>`` searched, DOTALL).
    """

    name = "tag_format"

    def __init__(self, think_opened_in_prompt: bool = False, strict: bool = True) -> None:
        super().__init__()
        self.think_opened_in_prompt = think_opened_in_prompt
        self.strict = strict

    @staticmethod
    def _contains_pair(text: str, opened: bool) -> bool:
        """Whether some ``</think>`` (after a ``<think>`` unless ``opened``) is followed, whitespace
        aside, by ``<answer>`` and later by ``</answer>``. Linear: the whitespace runs after distinct
        ``</think>`` tags do not overlap."""
        first_think = 0 if opened else text.find("<think>")
        last_close = text.rfind("</answer>")
        if first_think < 0 or last_close < 0:
            return False
        end = text.find("</think>", first_think)
        while end >= 0:
            answer = _WHITESPACE_RE.match(text, end + len("</think>")).end()
            if text.startswith("<answer>", answer) and last_close >= answer + len("<answer>"):
                return True
            end = text.find("</think>", end + 1)
        return False

    def score_one(self, completion: Any) -> float:
        """Score one completion; never raises."""
        if not isinstance(completion, str):
            return 0.0
        if not self.strict:
            return 1.0 if self._contains_pair(completion, self.think_opened_in_prompt) else 0.0
        text = completion.strip()
        expected = {"<think>": 0 if self.think_opened_in_prompt else 1, "</think>": 1, "<answer>": 1, "</answer>": 1}
        if any(text.count(tag) != n for tag, n in expected.items()):
            return 0.0
        if not self.think_opened_in_prompt and not text.startswith("<think>"):
            return 0.0
        thought_end, answer_start = text.index("</think>"), text.index("<answer>")
        if answer_start < thought_end or not text.endswith("</answer>"):
            return 0.0
        if text[thought_end + len("</think>"):answer_start].strip():  # only whitespace between the two
            return 0.0
        answer = text[answer_start + len("<answer>"):-len("</answer>")]
        return 1.0 if answer.translate(_ZERO_WIDTH).strip() else 0.0

    def compute(self, completions: list[str], answers: list[str]) -> list[float]:
        return [self.score_one(c) for c in completions]
