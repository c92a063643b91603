"""Evaluation metrics: the unbiased pass@k estimator and a torchmetrics accumulator.

For a problem with n sampled completions of which c are correct, the probability that at least
one of k completions drawn without replacement is correct is (Chen et al., 2021, Codex):

    pass@k = 1 - C(n - c, k) / C(n, k)

computed as a stable product. ``mean@k`` is the mean accuracy of the k samples (c / n), and
``pass@1`` on greedy completions is the usual benchmark accuracy. ``maj@n`` (self-consistency,
majority voting) is 1 when the most frequent answer among the n samples is right
(`majority_vote`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction

import torch
from torchmetrics import Metric

from qerl.answers import normalize_digits, normalize_minus
from qerl.math_parsing import _text_number, strip_end_punctuation


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``n`` samples, ``c`` of them correct (k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # 1 - prod_{i = n-c+1}^{n} (1 - k / i)
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


_LATEX_NOISE = re.compile(r"\\[!,;: ]|\\?\$|\{,\}|\\(?:left|right)(?![a-zA-Z])")
_OUTER_PARENS = re.compile(r"^\\?\((.*?)\\?\)$")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# `\frac{12}{5}`, `\frac125` (LaTeX: 1/2 then 5, so no match), `\dfrac{-1}2`, `12/5`; an argument without braces is one digit
_FRACTION = re.compile(r"^([-+]?)\\[dt]?frac(?:\{([-+]?\d+)\}|(\d))(?:\{(\d+)\}|(\d))$|^([-+]?\d+)/(\d+)$")
# spellings of one LaTeX expression (`\dfrac{\pi}{2}`, `\frac\pi2`; `\sqrt2`, `\sqrt{2}`): the forms a wrong answer
# votes in, so that it is one vote however written (a right answer is one vote already: the grader matched each)
_LATEX_SPELLINGS = ((re.compile(r"\\[dt]frac(?![A-Za-z])"), r"\\frac"),
                    (re.compile(r"\\(frac|sqrt|binom)(?![A-Za-z])\s*([0-9A-Za-z]|\\[A-Za-z]+)"), r"\\\1{\2}"),
                    (re.compile(r"\\(frac|binom)(\{(?:[^{}]|\{[^{}]*\})*\})\s*([0-9A-Za-z]|\\[A-Za-z]+)"),
                     r"\\\1\2{\3}"))
_DECIMAL = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)$")
_PERCENT = re.compile(r"\\?%$")


def vote_key(answer: str | None) -> str:
    """What a wrong answer votes for: its exact value when it is a number -- an integer, a decimal
    or a fraction (``\\frac{1}{2}``, ``\\dfrac12``, ``1/2``, ``0.5`` alike), also with thousands
    commas, ``$``, ``%``, LaTeX spacing, outer parentheses, a Unicode minus or unit words (``1,000``,
    ``$1000``, ``1000.0``, ``1\\,000``, ``\\text{1000 apples}`` alike, as the grader scores them)
    -- else its text without blanks, ``$``, LaTeX spacing and ``\\left`` / ``\\right``, in one spelling
    (``\\dfrac{\\pi}{2}``, ``\\frac\\pi2`` → ``\\frac{\\pi}{2}``; ``\\sqrt2`` → ``\\sqrt{2}``); a tuple or
    interval (``(2,100)``, ``[1, 2]``) is text, never the number its digits would spell; "" for no answer (no vote)."""
    if answer is None:
        return ""
    answer = normalize_digits(normalize_minus(answer))
    if len(text := "".join(answer.split())) > 64:  # not a number anyone writes; and the patterns would backtrack
        return text
    text = "".join(_LATEX_NOISE.sub("", answer).split())
    for spelling, canonical in _LATEX_SPELLINGS:
        text = spelling.sub(canonical, text)
    core = answer.strip()
    # unit words as the grader reads them (`\text{18 dollars}`, `18 dollars`; not `3 million`, `2 pi`)
    core = _text_number(strip_end_punctuation(core)) or core
    squeezed = "".join(_LATEX_NOISE.sub("", core).split())
    if squeezed[:1] in ("(", "[") and "," in squeezed:  # (plain brackets: \( \) only delimit maths)
        return text
    bare = "".join(_THOUSANDS.sub("", core).split())  # (commas first: blanks tell "2, 100" apart)
    bare = _PERCENT.sub("", _OUTER_PARENS.sub(r"\1", _LATEX_NOISE.sub("", bare)))
    if _DECIMAL.match(bare):
        return str(Fraction(bare))
    if (m := _FRACTION.match(bare)) and int(m[4] or m[5] or m[7]) != 0:
        sign, num, den = (m[1], m[2] or m[3], m[4] or m[5]) if m[6] is None else ("", m[6], m[7])
        return str(Fraction(int(num), int(den)) * (-1 if sign == "-" else 1))
    return text


def majority_vote(correct: Sequence[bool], answers: Sequence[str | None]) -> float:
    """maj@n of one problem: whether the most frequent of its n sampled answers is right.

    The right samples are one vote (the grader found each equal to the gold, so they are equal to
    each other whatever their spelling: ``0.5`` and ``\\frac{1}{2}``); wrong ones vote by
    :func:`vote_key` (one value for each number however written, else the text without blanks),
    and a sample without an answer does not vote. A tie with a wrong answer counts as the chance of
    winning it by a coin flip (1 / number of tied answers).
    """
    if len(correct) != len(answers):
        raise ValueError(f"{len(correct)} correctness flags for {len(answers)} answers")
    right = sum(bool(c) for c in correct)
    wrong: dict[str, int] = {}
    for ok, answer in zip(correct, answers):
        key = vote_key(answer)
        if not ok and key:
            wrong[key] = wrong.get(key, 0) + 1
    if right == 0:
        return 0.0
    top_wrong = max(wrong.values(), default=0)
    if right != top_wrong:
        return float(right > top_wrong)
    return 1.0 / (1 + sum(1 for v in wrong.values() if v == top_wrong))


class PassAtK(Metric):
    """Accumulates per-problem correctness and reports ``pass@1`` (greedy), ``mean@n`` (the mean
    accuracy of the n samples), ``pass@k`` (unbiased estimator from n samples) for each k, and
    ``maj@n`` (majority voting over the n samples) when `update` is given the votes.

    Args:
        k: samples per problem, n (0 = greedy only).
        pass_k: the k of the reported pass@k, each 2 <= k <= n (default: n alone). Sampled pass@1
            is mean@n, so it is never reported under ``pass@1``, which stays the greedy number (a 1
            in the list asks for that, always reported).
    """

    full_state_update = False

    def __init__(self, k: int = 0, pass_k: Sequence[int] | None = None, **kwargs):
        super().__init__(**kwargs)  # torchmetrics' options (sync_on_compute, ...)
        self.k = k
        asked = {int(x) for x in (pass_k if pass_k is not None else [k])}
        wanted = sorted(asked - {1} if pass_k is not None else asked - {0, 1})  # (1: the greedy pass@1, always there)
        bad = [x for x in wanted if not 2 <= x <= k]  # with k = 0 every asked k (no samples to estimate from)
        if bad:
            raise ValueError(f"pass@k needs 2 <= k <= samples ({k}); got k = {bad}")
        self.pass_k = wanted if k > 0 else []
        # float64 sums: pass@k terms are fractions, and float32 would show in the report's digits
        zero = torch.tensor(0.0, dtype=torch.float64)
        self.add_state("greedy_correct", default=zero.clone(), dist_reduce_fx="sum")
        self.add_state("sampled_mean", default=zero.clone(), dist_reduce_fx="sum")
        self.add_state("sampled_pass", default=torch.zeros(len(self.pass_k), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("problems", default=zero.clone(), dist_reduce_fx="sum")
        self.add_state("majority", default=zero.clone(), dist_reduce_fx="sum")
        self.add_state("voted", default=zero.clone(), dist_reduce_fx="sum")  # problems with maj@n scores

    def update(self, greedy_correct: torch.Tensor, sampled_correct: torch.Tensor | None = None,
               majority: torch.Tensor | None = None) -> None:
        """``greedy_correct``: (P,) 0/1; ``sampled_correct``: (P, n) 0/1, or None when n = 0;
        ``majority``: (P,) each problem's `majority_vote`, or None (no ``maj@n`` reported)."""
        if majority is not None and self.k > 1:
            self.majority += majority.double().sum()
            self.voted += majority.numel()
        self.greedy_correct += greedy_correct.double().sum()
        self.problems += greedy_correct.numel()
        if sampled_correct is not None and self.k > 0:
            n = sampled_correct.shape[1]
            c = sampled_correct.double().sum(1)
            self.sampled_mean += (c / n).sum()
            for j, k in enumerate(self.pass_k):
                self.sampled_pass[j] += sum(pass_at_k(n, int(ci), k) for ci in c.tolist())

    def compute(self) -> dict[str, torch.Tensor]:
        # float64 throughout: 2/3 reads 0.6666666666666666 in the JSON report, not float32's 0.6666666269302368
        p = self.problems.clamp(min=1)
        out = {"pass@1": self.greedy_correct / p}
        if self.k > 0:
            out[f"mean@{self.k}"] = self.sampled_mean / p
            for j, k in enumerate(self.pass_k):
                out[f"pass@{k}"] = self.sampled_pass[j] / p
        if self.k > 1 and self.voted > 0:
            out[f"maj@{self.k}"] = self.majority / self.voted
        return out
