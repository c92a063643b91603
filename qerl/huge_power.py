"""Numbers too large to hand to math-verify: a bound on the magnitude of the powers in a text.

``has_huge_power`` says whether a text may hold a power whose value passes 10^(10^6), which
math-verify's numeric check cannot be interrupted in; ``_same_text`` is how such answers are compared
instead (``qerl.rewards``). Pure functions, one linear scan, no sympy.
"""

from __future__ import annotations

import math
import re

from qerl.math_parsing import _TEXT_MACROS

# math-verify compares numerically with sympy's evalf; for a power whose exponent is itself astronomically large
# (`10^{10^{10^{10}}}`, `2^{2^{2^{35}}}`, `e^{10^{10^{10}}}`, `10**10**10**10` in plain text) mpmath shifts a
# mantissa by that exponent's bit count (`tman<<texp`): one C-level big-integer operation that SIGALRM cannot
# interrupt (10-19 s and ~9 GB measured; `2^{2^{2^{37}}}` asks for 16+ GB). It starts to cost at an exponent
# of ~2^(2^30) (`2^{2^{2^{30}}}`: 0.6 GB, `2^{2^{2^{32}}}`: 1.7 GB and 0.5 s past a 2 s deadline), an exponent
# of ~3*10^8 digits: that is where the uninterruptible cost starts. A power (or `\exp`) whose value may exceed
# 10^(10^6) is kept from math-verify; below it no power math-verify evaluates has more than 10^6 digits (~3.3 Mbit),
# whose products and shifts take milliseconds (measured with math-verify 0.9: `10^{1000000}` against `y^2` 0.4 s,
# `2^{3321928}` against `4^{1660964}` 0.04 s; a slower symbolic path, `99^{99^{2}}` against `99^{9801}`, runs in
# Python and stops at the deadline). Two orders of magnitude in digits below where the cost starts, and far above
# real answers (2^{2007} has 605 digits, 10^{100} 101), so that their equivalent forms (`2^{40000}` and `4^{20000}`,
# `1.0001^{10000}` and `(1.0001)^{10000}`), which the former bound, 10^10000, sent to a text comparison, are matched.
_MAX_POWER_LOG10 = 1_000_000.0
_FINITE_CAP = 1e250  # a log10 bound kept finite (as an exponent it folds to inf; sums of such stay finite)
_LOG10_2 = math.log10(2)
_CONSTANT_LOG10 = {"e": math.log10(math.e), "pi": math.log10(math.pi)}  # (`e` is Euler's number to math-verify)
_EXP_COMMANDS = frozenset({"exp"})  # `\exp(y)`: e^y
# Commands whose value is in the bracket groups after them: after a `^` they leave the exponent to come
# (`2^\frac{1}{2}`, `2^\left(...\right)`), where any other command is the exponent (`90^\circ`, `x^\prime`).
_ARGUMENT_COMMANDS = frozenset(
    f"frac dfrac tfrac cfrac sqrt left right bigl bigr Bigl Bigr big Big binom dbinom tbinom operatorname mathbf "
    f"displaystyle {_TEXT_MACROS.replace('|', ' ')}".split())
# One token each: a decimal literal | a power operator (`^`, and `**`, which math-verify reads in plain text)
# | factorial signs | a command or escaped character | an opening bracket | a closing bracket | a word.
# Anything else (operators, punctuation) separates items; whitespace is skipped.
_MAGNITUDE_TOKEN_RE = re.compile(
    r"(\d+(?:\.\d*)?|\.\d+)|(\^|\*\*)|(!+)|\\([A-Za-z]+|.)|([{(\[])|([})\]])|([A-Za-z]+)|\S", re.DOTALL)


def _literal_log10(literal: str) -> float:
    """log10 of a decimal literal's magnitude, at least 0, and at least its count of decimals: a
    decimal can divide (1/0.001 is 1000), so its reciprocal is bounded too."""
    whole, _, decimals = literal.partition(".")
    whole = whole.lstrip("0")
    size = math.log10(float(whole[:17])) + max(len(whole) - 17, 0) if whole else 0.0
    return max(size, float(len(decimals)))


def _pow10(log10: float) -> float:
    """10**log10 without OverflowError (inf past a float's range)."""
    return 10.0 ** log10 if log10 < 300.0 else math.inf


def _fold_power_chain(chain: list[float]) -> float:
    """log10 bound of ``a^b^c...`` (right-associative, as math-verify reads both ``2^{2^{10}}`` and
    ``2**2**10``) from the operands' log10 bounds; inf once any partial power passes `_MAX_POWER_LOG10`.
    A base of magnitude <= 1 (``1``, a symbol) gives 0 whatever its exponent."""
    result = chain[-1]
    for base in reversed(chain[:-1]):
        result = _pow10(result) * base if base > 0.0 else 0.0
        if result > _MAX_POWER_LOG10:
            return math.inf
    return result


def _factorial_log10(log10: float) -> float:
    """log10 bound of n! for n <= 10**log10 (Stirling, rounded up), capped at `_FINITE_CAP`: a factorial
    alone is no power (``99999999!`` stops at the deadline); only a power over one is checked."""
    n = _pow10(log10)
    if n < 2.0:
        return 0.0
    return min(n * (log10 - _CONSTANT_LOG10["e"]) + 0.5 * math.log10(2 * math.pi * n) + 1.0, _FINITE_CAP)


class _Group:
    """One bracket level of `has_huge_power`'s scan: its finished items' log10 bounds, summed, and the power
    chain being read (``a ^ b ^ c``: operands, and whether a ``^`` still waits for its exponent). ``huge``:
    some power in it passed the bound."""

    __slots__ = ("total", "numbers", "chain", "numeric_chain", "awaits_exponent", "huge")

    def __init__(self) -> None:
        self.total, self.numbers = 0.0, 0
        self.chain: list[float] = []
        self.numeric_chain = self.awaits_exponent = self.huge = False

    def item(self, log10: float, numeric: bool) -> None:
        """A literal, constant, symbol or closed group: the pending exponent, or the start of a new chain."""
        if not self.awaits_exponent:
            self.end_chain()
        self.chain.append(log10)
        self.numeric_chain |= numeric
        self.awaits_exponent = False

    def caret(self) -> None:
        if not self.chain:  # a base the scan does not value (`\sigma^2`): magnitude <= 1, as a symbol's
            self.chain.append(0.0)
        self.awaits_exponent = True

    def factorial(self) -> None:
        """``n!`` on the chain read so far: ``(a^b)!`` (LaTeX) or ``a^(b!)`` (plain text), the larger."""
        if self.chain and not self.awaits_exponent:
            whole = self._fold(self.chain)
            last = self._fold(self.chain[:-1] + [_factorial_log10(self.chain[-1])])
            self.chain = [max(_factorial_log10(whole), last)]

    def separator(self, before_exponent: bool = False) -> None:
        """An operator, punctuation or command: the end of the chain, unless it may come between a ``^`` and
        its exponent (``before_exponent``: the sign of ``2^-5``, the ``\\left`` of ``2^\\left(``)."""
        if self.awaits_exponent and before_exponent:
            return
        self.awaits_exponent = False
        self.end_chain()

    def end_chain(self) -> None:
        if self.chain:
            self.total = min(self.total + self._fold(self.chain), _FINITE_CAP)
            self.numbers += self.numeric_chain
        self.chain, self.numeric_chain = [], False

    def close(self) -> tuple[float, bool]:
        """The group's log10 bound and whether it holds a number: k numbers combined by + - * are at most
        2^k times the product of their magnitudes (each counted as at least 1), whatever the operators."""
        self.end_chain()
        return self.total + (self.numbers * _LOG10_2 if self.numbers > 1 else 0.0), self.numbers > 0

    def _fold(self, chain: list[float]) -> float:
        result = _fold_power_chain(chain)
        if math.isinf(result):
            self.huge = True
            return _FINITE_CAP
        return result


# What two answers' texts are compared without: whitespace, `$`, `\left`/`\right` and LaTeX spacing (`\,`, `\!`)
_TEXT_NOISE_RE = re.compile(r"\s+|\$|\\(?:left|right)(?![A-Za-z])|\\[,!:; ]")


def _same_text(a: str, b: str) -> bool:
    """Whether two answers are the same text, up to whitespace, ``$``, ``\\left``/``\\right``, LaTeX spacing
    and a final period: how answers that math-verify must not compare (`has_huge_power`) are matched."""
    def plain(text: str) -> str:
        return _TEXT_NOISE_RE.sub("", text).removesuffix(".")

    return plain(a) == plain(b)


def has_huge_power(text: str) -> bool:
    """Whether ``text`` may hold a power (``a^b``, ``a^{...}`` nested, ``a**b``, ``e^{...}``, ``\\exp``; a
    factorial counts inside one) whose value passes 10^(10^6) (`_MAX_POWER_LOG10`), which math-verify must
    not compare (see above). An upper bound, in one linear scan that never raises: a literal counts its
    magnitude, ``e`` and ``\\pi`` theirs, any other symbol 1 (a word: the product of its letters); a
    bracket group at most the product of its numbers times 2 per number, so sums, products, signs and
    fractions are covered. Only powers are checked: a sum or product of numbers below the bound costs
    math-verify no more than its parts."""
    if "^" not in text and "**" not in text and "\\exp" not in text:  # (no power at all: most text, at C speed)
        return False
    stack = [_Group()]
    for m in _MAGNITUDE_TOKEN_RE.finditer(text):
        literal, caret, bang, command, opening, closing, word = m.groups()
        group = stack[-1]
        if literal is not None:
            group.item(_literal_log10(literal), True)
        elif caret is not None:
            group.caret()
        elif bang is not None:
            group.factorial()
        elif command in _EXP_COMMANDS:
            group.item(_CONSTANT_LOG10["e"], True)
            group.caret()
        elif command == "pi":
            group.item(_CONSTANT_LOG10["pi"], True)
        elif command is not None and (command in _ARGUMENT_COMMANDS or not command.isalpha()):
            group.separator(before_exponent=True)
        elif command is not None:  # a symbol (`\sigma`, `\circ`): an exponent after `^`, else a separator
            if group.awaits_exponent:
                group.item(0.0, False)
            else:
                group.separator()
        elif opening is not None:
            stack.append(_Group())
        elif closing is not None and len(stack) > 1:
            stack.pop()
            stack[-1].item(*group.close())
            stack[-1].huge |= group.huge
        elif word is not None:  # a product of symbols, with e and pi (plain text) as the numbers they are
            constants = word.count("e") * _CONSTANT_LOG10["e"] + word.count("pi") * _CONSTANT_LOG10["pi"]
            group.item(constants, constants > 0)
        else:  # operators, punctuation, a stray closing bracket
            group.separator(before_exponent=m.group() in "+-")
        if stack[-1].huge:
            return True
    while len(stack) > 1:  # unclosed brackets, closed at the end
        group = stack.pop()
        stack[-1].item(*group.close())
        stack[-1].huge |= group.huge
    stack[0].end_chain()
    return stack[0].huge
