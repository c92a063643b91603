"""Reward functions for math RL (GRPO/DAPO): answer extraction, math-verify accuracy, format.

Every reward is a `RewardFunction` (``qerl/reward_function.py``): ``reward(completions, answers) ->
list[float]`` where ``answers`` are gold answers that the data pipeline has already parsed to plain
strings (e.g. ``extract_gsm8k_gold`` for GSM8K, the ``answer`` field for MATH). YAML configs pick
them by ``class_path`` (jsonargparse), so constructors take only simple typed keyword arguments::

    reward:
      class_path: qerl.rewards.WeightedSum
      init_args:
        rewards:
          - class_path: qerl.rewards.MathAccuracy
          - class_path: qerl.rewards.FormatReward
        weights: [1.0, 0.2]

Relation to the QeRL code (research notes §4.5): its BigMath reward is math-verify accuracy
(boxed first, 1.0/0.0) plus a 0.2 format bonus, summed with weight 1; its GSM8K reward compares
``<answer>`` tags exactly. Here both datasets use the boxed/math-verify path, which is robust to
``1,000`` vs ``1000`` or ``\\frac12`` vs ``0.5`` where exact string matching is not. Extraction
order (see `MathAccuracy`): the last ``\\boxed{}``; without one, a GSM8K-style ``#### N`` line;
then the tail of the whole completion.

Safety: a reward is called on arbitrary model output, so no call may raise or hang.
``MathAccuracy`` parses at most ``max_chars`` of a completion, catches every exception (→ 0.0, with a
rate-limited warning), and bounds each parse/verify with a wall-clock deadline (``qerl.deadline``); an
answer or gold with a power past 10^(10^6), whose numeric check no deadline can stop, is compared as text.
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Any, NamedTuple

import math_verify

from qerl import drop_log_lines
from qerl.answers import (  # noqa: F401
    _ZERO_WIDTH, _boxed_spans, answer_tag_content, boxed_answers, clean_hash_answer, extract_answer, extract_boxed,
    extract_gsm8k_gold, final_hash_line, hash_answer, hash_line_hedges, is_long_integer, long_integers_equal,
    minus_before_dollar, normalize_digits, normalize_minus, unwrap_emphasis)
from qerl.deadline import call_with_deadline as _deadline
from qerl.format_rewards import FormatReward, TagFormatReward  # noqa: F401 (re-exported: configs name qerl.rewards.X)
from qerl.huge_power import _MAX_POWER_LOG10, _same_text, has_huge_power  # noqa: F401 (re-exported)
from qerl.math_parsing import (  # noqa: F401 (re-exported)
    _DIGIT_SEP_RE, _SPACE_SEP_RE, _is_multi_valued, _parse_gold, _parse_pred, _text_number, closes_at_infinity,
    degrees_as_circ, float_rounding, has_expression, is_bare_math, lists_several_values, parse_hash_line,
    percents_as_numbers, starts_with_relation)
from qerl.reward_function import RewardFunction, _warn_limited

logger = logging.getLogger(__name__)
_long_integer_warned = [False]  # (once per process: a data set's long golds would repeat it every step)

# ----------------------------------------------------------------------------------------------
# Bounded execution (the deadline itself: qerl/deadline.py)
# ----------------------------------------------------------------------------------------------


# math-verify warns once that its timeout is disabled; we disable it on purpose (see `qerl.deadline`),
# so the message would only mislead.
for _name in ("math_verify.parser", "math_verify.grader"):
    drop_log_lines(_name, "Timeout is disabled")

# ----------------------------------------------------------------------------------------------
# Reward functions
# ----------------------------------------------------------------------------------------------


def _compared_as_text(answers: list[str], gold: str) -> bool:
    """The verdict when an answer or the gold holds a power tower (`has_huge_power`): math-verify's numeric
    check of ``10^{10^{10^{10}}}`` cannot be interrupted by any deadline, so the texts are compared."""
    _warn_limited(f"MathAccuracy: a power past 10^{_MAX_POWER_LOG10:.0f} in the answer {(answers or [''])[-1][:80]!r} "
                  f"or the gold {gold[:80]!r}: compared as text (math-verify's numeric check cannot be interrupted)")
    return any(_same_text(answer, gold) for answer in answers)


class _Prediction(NamedTuple):
    """What a completion is scored on (`MathAccuracy._prediction`)."""

    text: str  # the normalised completion
    boxed: str | None  # its last box's content, an `<answer>` span read as one, or the cleaned `####` line
    pred_text: str  # the text math-verify parses: `\boxed{<boxed>}`, the `####` line, or the completion's tail
    hash_line: bool  # `boxed` is the line after `####` (`parse_hash_line` reads it)


class MathAccuracy(RewardFunction):
    """1.0 if the completion's final answer equals the gold answer under math-verify, else 0.0.

    Extraction order: the last ``\\boxed{}`` content, with LaTeX thousands separators between
    digits removed (``5\\,000``, ``5{,}000``, ``5\\!000`` → ``5000``); if it is a number
    written with unit words (``\\text{18 dollars}``, ``18 dollars``) or a unit symbol (``15 cm^2``, ``20 km/h``;
    1- and 2-letter symbols from a whitelist, so ``3 x^2`` stays algebra), that number is the answer
    (a gold so written is its number too). Without a box (unless ``boxed_only``): the last ``<answer>...</answer>`` (R1 style),
    read as a box is when it is maths alone and as text when it has words (scored 0 if it hedges, as a
    ``####`` line; so is a last ``####`` line in words: ``#### It is not 72``); else the line after the
    last ``####`` (GSM8K style), cleaned (`clean_hash_answer`), scored 0 if it hedges (``71 or 72``), starts with
    a relation (``> 72``) or lists several values (``16, 17, 18``) where the gold does not, else read both as a
    box and as math-verify's plain text (`parse_hash_line`); else the whole (tail of the) completion, where
    math-verify takes the last LaTeX/number expression. Equivalences handled include
    ``\\frac{1}{2}``/``0.5``/``1/2``, ``1,000``/``1000``, ``\\$5``/``5`` and ``5\\%``/``5``; decimals are compared
    to 6 places or as many as the gold or answer writes (`float_rounding`). Words after a boxed number that make
    it another answer or none (``70\\text{ thousand}``, ``18\\text{ is wrong}``) score 0.
    An answer or gold with a power past 10^(10^6) (``10^{10^{10^{10}}}``) is compared as text, not by
    math-verify, whose numeric check would run past any deadline on it (`has_huge_power`); without a box,
    the answer checked is what math-verify's lazy parse takes from the tail, not the reasoning before it.

    Args:
        boxed_only: If True, a completion without ``\\boxed{}`` scores 0 (no fallback parse).
        answer_tag: If True, only the content of the last ``<answer>...</answer>`` is scored (R1-style
            prompts; the rules above apply inside it) and a completion without one scores 0.
        timeout_s: Wall-clock limit per completion for parse + verify (main thread only); 0 or
            ``.inf`` for none.
        max_chars: The most characters math-verify parses (its regexes and LaTeX parser can be slow
            on very long text): the box's content (a longer box scores 0) or, without a box, the
            completion's last ``max_chars`` characters. The box itself is found in the whole text.
    """

    name = "accuracy"

    def __init__(self, boxed_only: bool = False, timeout_s: float = 2.0, max_chars: int = 10_000,
                 answer_tag: bool = False) -> None:
        super().__init__()
        if not timeout_s >= 0:  # also refuses NaN
            raise ValueError(f"MathAccuracy: timeout_s must be >= 0 (0 or .inf: no limit), got {timeout_s}")
        self.boxed_only = boxed_only
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self.answer_tag = answer_tag
        self._warmed_up = False

    def _warm_up(self) -> None:
        # The first parse loads the ANTLR LaTeX grammar (~0.2 s); doing it outside the deadline
        # keeps the first real completion from timing out spuriously.
        # It also proves math-verify works: a broken install would otherwise score every completion 0
        # (each failure is only a rate-limited warning) and training would go on without a signal.
        if not self._warmed_up:
            try:
                ok = math_verify.verify(list(_parse_gold("1")), _parse_pred("\\boxed{1}"), timeout_seconds=None)
            except Exception as e:  # noqa: BLE001
                raise RuntimeError(f"MathAccuracy: math-verify fails on \\boxed{{1}} vs '1' ({type(e).__name__}: {e}); "
                                   "check its install (pip install 'math-verify[antlr4_13_2]')") from e
            if not ok:
                raise RuntimeError("MathAccuracy: math-verify does not match \\boxed{1} with '1'; check its install")
            self._warmed_up = True

    def _prediction(self, completion: Any) -> _Prediction | None:
        """What a completion is scored on, or None when it scores 0 whatever the gold (no box under
        ``boxed_only``, no answer tag, an over-long box, a hedged ``####`` line)."""
        if not isinstance(completion, str):
            return None
        if self.answer_tag:
            completion = answer_tag_content(completion)
            if completion is None:
                return None
        # Unicode digits as ASCII and zero-width characters gone (`\boxed{１２}`, `1\u200b2`), in the
        # completion and the gold alike: math-verify reads neither as 12.
        # Replace rather than add, in the box, an unboxed answer and the gold alike: math-verify 0.9
        # reads `5\,000` as 5*0 = 0 and `5\,001` as 6.
        # A Unicode minus (`−5`, `\boxed{–3}`) as `-`, in the box as in the tail (`normalize_minus`: not a range's dash).
        text = _DIGIT_SEP_RE.sub("", normalize_digits(normalize_minus(completion)))
        # The last box of the whole completion (linear time), as FormatReward and extract_answer read it:
        # a right box then a long ramble is right; a wrong one is not rescued by a later bare number.
        # Only what math-verify parses is capped (`limit`: the box, or the tail without one).
        limit = self.max_chars if self.max_chars > 0 else len(text)
        boxed, span = extract_boxed(text), None
        if boxed is None and not self.boxed_only:  # an R1-style `<answer>` span (answer_tag: text is the span)
            span = text if self.answer_tag else answer_tag_content(text)
            span = unwrap_emphasis(span) if span is not None else None
            if span and len(span) <= limit and is_bare_math(span):
                boxed, span = span, None  # maths alone (`\sqrt{51}`, `\pi`): read as a box is, whole
            elif span and hash_line_hedges(span):
                return None  # in words, hedged or denied (`72 is not correct`, `71 or 72`), as a `####` line
        if boxed is None and self.boxed_only:
            return None
        # Without a box, the tail (answers sit at the end), with `−5` read as -5 as it is inside LaTeX.
        # A span in words (`The answer is 72`, `72 clips`) is parsed as text: boxed, math-verify would
        # read the words as a product of symbols.
        tail = minus_before_dollar((span or text)[-limit:]) if boxed is None else ""
        line = hash_answer(tail) if boxed is None else None
        if boxed is None and line is None and hash_line_hedges(final_hash_line(tail) or ""):
            return None  # a last `####` line in words that hedges (`#### It is not 72`, `#### either 71 or 72`)
        if line is not None:  # math-verify alone reads a `####` line's last number: `17 or 18`, `> 18` were 18
            boxed = clean_hash_answer(line)
            if hash_line_hedges(boxed):  # (`18 is not right`, `17 (not 18)`: no answer whatever the gold)
                return None
        if boxed is not None:  # a plain space as the separator, only in the answer itself (`\boxed{12 345}`)
            boxed = _SPACE_SEP_RE.sub("", boxed)
            if line is None:  # `30°` as the gold's `30^\circ` (a `####` line's `-5 °C` is read as text)
                boxed = degrees_as_circ(boxed)
            if len(boxed) > limit:  # no answer is that long, and parsing it is what the cap prevents
                return None
        # Re-box the extracted content so math-verify sees exactly the last box (its boxed regex
        # is brace-balanced) rather than whatever else the completion contains. (A `####` line: `parse_hash_line`.)
        pred_text = tail if boxed is None else boxed if line is not None else "\\boxed{" + boxed + "}"
        return _Prediction(text, boxed, pred_text, line is not None)

    def scored_answer(self, completion: Any) -> str | None:
        """The answer `score_one` compares with the gold, as text (for reports next to its verdict): the last box's
        (or ``<answer>`` span's) content, the ``####`` line as `parse_hash_line` shows it, else what math-verify
        parsed from the tail; None when nothing is scored or the parse fails or times out. Never raises.
        (math-verify's parse alone is lazy: a power tower costs it nothing, only its comparison does.)"""
        prediction = self._prediction(completion)
        if prediction is None:
            return None
        boxed, pred_text = prediction.boxed, prediction.pred_text
        if boxed is not None and not prediction.hash_line:
            return boxed
        try:
            if prediction.hash_line:
                return _deadline(lambda: parse_hash_line(pred_text)[1], self.timeout_s)
            parsed = _deadline(lambda: _parse_pred(pred_text, None), self.timeout_s)
        except Exception:  # noqa: BLE001 - a report field, never a failure
            return None
        strings = [p for p in parsed if isinstance(p, str)]
        return strings[-1] if strings else None

    def score_one(self, completion: Any, gold: Any) -> float:
        """Score one completion; never raises (errors and timeouts give 0.0)."""
        if not isinstance(gold, str) or not gold.strip():
            return 0.0
        prediction = self._prediction(completion)
        if prediction is None:
            return 0.0
        text, boxed, pred_text, hash_line = prediction
        limit = self.max_chars if self.max_chars > 0 else len(text)
        gold = degrees_as_circ(_SPACE_SEP_RE.sub("", _DIGIT_SEP_RE.sub("", normalize_digits(normalize_minus(gold)))))

        # a gold with unit words (`5 dollars`, `\text{5 cm}`: custom sets) is its number, as a
        # prediction's box is; math-verify alone reads `5 dollars` as 5*a*do*l*l*r*s
        gold_text = _text_number(gold.strip()) or gold.strip()
        if boxed is not None and starts_with_relation(boxed) and not starts_with_relation(gold_text):
            return 0.0  # `\neq 72`, `> 72`: math-verify keeps the 72 and drops the relation ("not 72" is no 72)
        if boxed is not None and closes_at_infinity(boxed) and not closes_at_infinity(gold_text):
            return 0.0  # `[-\infty, 3]`: math-verify matches it with `(-\infty, 3]` (sympy ignores a bracket at ±∞)
        if hash_line and lists_several_values(boxed) and not _is_multi_valued(gold_text):
            return 0.0  # `#### 16, 17, 18` lists candidates; only a gold with several values is answered so
        # integers longer than Python's int-string limit: math-verify cannot convert them (it scores 0
        # silently), so they are compared here as digit strings (linear; `limit` bounds the box), with unit words
        exact = long_integers_equal(gold_text, (_text_number(boxed) or boxed) if boxed is not None else None)
        if exact is not None:
            return 1.0 if exact else 0.0
        # a power tower (`10^{10^{10^{10}}}`) would hold math-verify past any deadline: compared as text, the box
        # or line before any parse; the tail in `run`, on what the parse takes from it (not the reasoning before)
        if boxed is not None and (has_huge_power(gold_text) or has_huge_power(boxed)):
            return 1.0 if _compared_as_text([boxed], gold_text) else 0.0
        if not _long_integer_warned[0] and is_long_integer(gold_text):
            _long_integer_warned[0] = True
            logger.warning("MathAccuracy: a gold integer of %d digits (more than Python's int-string limit, %d) is "
                           "matched only by a plain integer answer (boxed, or after ####); other forms of it score 0",
                           len(gold_text), sys.get_int_max_str_digits())

        def run() -> bool:
            # verify() only treats a *list* as alternatives; a tuple would be one odd expression.
            pred_parsed = list(parse_hash_line(boxed)[0]) if hash_line else _parse_pred(pred_text, boxed)
            if boxed is None:  # (the parse is lazy: `10^{10^{10}}` costs nothing until compared)
                strings = [p for p in pred_parsed if isinstance(p, str)]
                if has_huge_power(gold_text) or any(has_huge_power(s) for s in strings):
                    return _compared_as_text(strings, gold_text)
            gold_parsed = list(_parse_gold(gold_text))
            if not has_expression(gold_parsed):  # (`\frac{`): only a verbatim copy of it can match
                _warn_limited(f"MathAccuracy: math-verify reads no expression in the gold answer {gold_text[:80]!r}: "
                              "its completions will all score 0 unless they repeat it verbatim (fix or drop that row)")
                if not gold_parsed:
                    return False
            pred_parsed = percents_as_numbers(pred_parsed, gold_parsed)  # (`2500\%` is no answer to 25)
            # decimals compared to the places written (math-verify rounds to 6: `0.0000673` was `.0000672`)
            rounding = float_rounding(gold_text, boxed if boxed is not None else
                                      next((p for p in reversed(pred_parsed) if isinstance(p, str)), ""))
            if math_verify.verify(gold_parsed, pred_parsed, float_rounding=rounding, timeout_seconds=None):
                return True
            # A multi-answer gold (`1, -2`, `3 \pm 2\sqrt{2}`) is often boxed one value at a time:
            # then all boxes together are the answer (a set; extra or hedged values still fail).
            boxes = boxed_answers(text) if boxed is not None else []
            boxes = [degrees_as_circ(_SPACE_SEP_RE.sub("", b)) for b in boxes]  # (normalised as the last box was)
            if len(boxes) < 2 or not _is_multi_valued(gold_text):
                return False
            joined = ", ".join(boxes)
            if len(joined) > limit or has_huge_power(joined):  # (only the last box was checked above)
                return False
            return bool(math_verify.verify(gold_parsed, _parse_pred("\\boxed{" + joined + "}", joined),
                                           float_rounding=float_rounding(gold_text, joined), timeout_seconds=None))

        try:
            return 1.0 if _deadline(run, self.timeout_s) else 0.0
        except Exception as e:  # noqa: BLE001 - any failure on model output is just a wrong answer
            _warn_limited(f"MathAccuracy: {type(e).__name__}: {str(e)[:200]} -> reward 0.0")
            return 0.0

    def compute(self, completions: list[str], answers: list[str]) -> list[float]:
        self._warm_up()
        return [self.score_one(c, a) for c, a in zip(completions, answers)]


def accuracy_reward(reward) -> MathAccuracy | None:
    """The ``MathAccuracy`` in a training reward: the reward itself or, depth first, a member of a
    ``WeightedSum`` (``rewards``); None without one."""
    if isinstance(reward, MathAccuracy):
        return reward
    for member in getattr(reward, "rewards", None) or ():
        if (found := accuracy_reward(member)) is not None:
            return found
    return None


class WeightedSum(RewardFunction):
    """Weighted sum of several rewards; ``last_components`` keeps each one's values.

    Component names are the functions' ``name`` (``accuracy``, ``format``, ...); a repeated name
    gets a ``_<index>`` suffix so no component's log is overwritten.

    Args:
        rewards: The reward functions to combine.
        weights: One weight per reward; None means all 1.0 (the QeRL code sums with weight 1).
    """

    name = "weighted_sum"

    def __init__(self, rewards: list[RewardFunction], weights: list[float] | None = None) -> None:
        super().__init__()
        if not rewards:
            raise ValueError("WeightedSum needs at least one reward function")
        if weights is None:
            weights = [1.0] * len(rewards)
        if len(weights) != len(rewards):
            raise ValueError(f"{len(rewards)} rewards but {len(weights)} weights")
        bad = [i for i, w in enumerate(weights) if not math.isfinite(float(w))]
        if bad:  # a NaN weight makes every sum NaN, which RewardFunction then zeroes: no signal, every step
            raise ValueError(f"WeightedSum: weights must be finite, got weights[{bad[0]}] = {weights[bad[0]]}")
        self.rewards = list(rewards)
        self.weights = [float(w) for w in weights]
        self._keys: list[str] = []
        for i, r in enumerate(self.rewards):
            key = r.name if r.name not in self._keys else f"{r.name}_{i}"
            self._keys.append(key)
        self._pending: dict[str, list[float]] = {}

    def compute(self, completions: list[str], answers: list[str]) -> list[float]:
        self._pending = {}
        total = [0.0] * len(completions)
        for key, reward, weight in zip(self._keys, self.rewards, self.weights):
            values = reward(completions, answers)
            self._pending[key] = values
            total = [t + weight * v for t, v in zip(total, values)]
        return total

    def _components(self, values: list[float]) -> dict[str, list[float]]:
        return self._pending
