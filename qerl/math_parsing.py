"""math-verify parsing of gold answers and predictions, as ``qerl.rewards.MathAccuracy`` uses it.

math-verify 0.9 reads some common answer forms wrongly or not at all (``5\\,000`` as 0, ``5 dollars``
as a product of symbols, ``\\boxed{5\\%}`` as a string); the helpers here normalise or add
candidates for exactly those forms. Every function is pure; the caller bounds their run time.
"""

from __future__ import annotations

import re
from functools import lru_cache

import math_verify
from sympy import Basic, MatrixBase

from qerl.answers import _BOX_RE, hash_answer


@lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple:
    """Parse a gold string once: a GRPO group shares one gold across all its completions.

    Wrapped in ``$...$`` so LaTeX golds (``\\left( 3, \\frac{\\pi}{2} \\right)``) parse as LaTeX;
    returns a tuple so the cached value cannot be mutated by callers.
    """
    parsed = math_verify.parse(f"${gold}$", parsing_timeout=None)
    if not parsed:
        parsed = math_verify.parse(gold, parsing_timeout=None)
    return tuple(parsed)


# A LaTeX space (thin `\,`, negative `\!`, medium `\:` / `\;`, control `\ `, tie `~`) or `{,}` between
# a digit and a group of exactly three digits is a thousands separator (`5\,000`, `1\,234.5`,
# `5{,}000`, `1\ 000`); `(1,\,2)` and `5\,00` are left alone.
_DIGIT_SEP_RE = re.compile(r"(?<=\d)(?:\\[,!:; ]|~|\{,\})(?=\d{3}(?!\d))")
# The same with a plain, no-break or thin space (`12 345`: math-verify reads it as 12*345 -- 1 000 as
# 0); applied to the box and the gold, not to free text, where "3 100-page books" is two numbers.
_SPACE_SEP_RE = re.compile("(?<=\\d)[ \u00a0\u2009\u202f](?=\\d{3}(?!\\d))")
_TEXT_MACROS = r"text|textrm|textbf|textnormal|mbox|hbox|mathrm"  # (one list: \text{} units and loose boxes)
_TEXT_RE = re.compile(rf"\\(?:{_TEXT_MACROS})\s*\{{([^{{}}]*)\}}")
# A whole `\text{}`-unwrapped box that is one number, optionally followed by unit words.
_NUMBER_UNITS_RE = re.compile(r"\s*((?:\\\$?\s*|\$\s*)?[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+))(?:\s+([A-Za-z][A-Za-z\s.]*))?")
# A box without LaTeX: one number, then words whose first has 3+ letters (`18 dollars`, `5 USD`;
# not `3 x`, `2 pi`, which are algebra) and none of which is maths or a magnitude (`2 sin x`,
# `4 factorial`, `3 million`, `5 less than x` are other answers than the number).
_BARE_NUMBER_UNITS_RE = re.compile(r"\s*([-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+))\s+([A-Za-z]{3,}[A-Za-z\s.]*)")
_NOT_UNITS = frozenset(
    "sin cos tan cot sec csc sinh cosh tanh arcsin arccos arctan log ln exp sqrt root roots factorial squared "
    "cubed power powers times plus minus over divided and or less more than fewer greater smaller hundred "
    "hundreds thousand thousands million millions billion billions trillion dozen dozens percent half halves "
    "third thirds quarter quarters pi".split())


# Boxes that math-verify 0.9 leaves as strings although their `$content$` is the number.
_LOOSE_BOX_RE = re.compile(rf"%|\\(?:{_TEXT_MACROS}|operatorname|unit)(?![a-z])")


# a relation or negation with nothing on its left: `\neq 72`, `\geq 5`, `\nleq 5`, `\notin A`, `> 3`,
# `{\ge} 5`, `≤ 4`; not GSM8K's `<<2*9=18>>` calculator markup nor an angle-bracket vector `<1, 2>`
_LEADING_RELATION_RE = re.compile(
    r"^\s*\{?\s*(?:\\(?:n?[lg]eq?q?|n?[lg]eqslant|[lg]neq?q?|[lg]t|ll|gg|ne|neq|not[a-z]*|neg|lnot|nless|ngtr)"
    r"(?![A-Za-z])|[≠≤≥≮≯≰≱⩽⩾]|!=|>|<(?![<])(?![^<>]*>\s*$))")


def starts_with_relation(text: str) -> bool:
    """Whether ``text`` starts with a relation or negation that has no left side (``\\neq 72``, ``> 72``,
    ``\\geq 5``, ``\\nleq 5``, ``\\neg 72``): an answer that is *not* its number, which math-verify
    would still read as that number. ``\\approx 72`` is not one (approximately 72 is 72), nor
    ``x > 72``, GSM8K's ``<<2*9=18>>18`` or a vector ``<1, 2, 3>``."""
    return bool(_LEADING_RELATION_RE.match(text))


def strip_end_punctuation(text: str) -> str:
    """``text`` without one closing ``.``, ``,`` or ``;`` and the spaces before it, unless that mark
    continues an ellipsis (``18, ...`` is a sequence, ``0.33...`` is 1/3). Linear time: the regex
    search this replaces, ``(?<!\\.)[ ]*[.,;]$``, was quadratic in a run of spaces (1.6 s on 10k)."""
    if not text or text[-1] not in ".,;":
        return text
    head = text[:-1]
    kept = head.rstrip(" ")
    if not kept.endswith("."):
        return kept
    return head[:len(kept) + 1] if len(head) > len(kept) else text  # (the regex's match after one space)


# A gold with several values: a comma outside brackets (`1, -2`; not `(1,2)` or `[0, 1)`) or `\pm`.
_PM_RE = re.compile(r"\\(?:pm|mp)(?![A-Za-z])")
_THOUSANDS_COMMA_RE = re.compile(r"(?<=\d),(?:\\!\s?)?(?=\d{3}(?!\d))")  # (`2, 100` is two values)


def _is_multi_valued(gold: str) -> bool:
    if _PM_RE.search(gold):
        return True
    depth = 0
    for ch in _THOUSANDS_COMMA_RE.sub("", gold).replace("\\{", "{").replace("\\}", "}"):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth <= 0:
            return True
    return False


def _text_number(boxed: str) -> str | None:
    """``\\text{18 dollars}`` or ``18 dollars`` → ``18``: the number of a box that, with ``\\text{}``
    unwrapped, is one number plus unit words; None for anything else (``\\text{Evelyn}``, ``2 and 3``)."""
    if "\\" not in boxed:
        m = _BARE_NUMBER_UNITS_RE.fullmatch(boxed)
        if m is None or any(w.lower() in _NOT_UNITS for w in re.findall(r"[A-Za-z]+", m.group(2))):
            return None
        return m.group(1)
    unwrapped = _TEXT_RE.sub(r"\1", boxed)
    if unwrapped == boxed:
        return None
    m = _NUMBER_UNITS_RE.fullmatch(unwrapped)
    if m is None or any(w.lower() in _NOT_UNITS for w in re.findall(r"[A-Za-z]+", m.group(2) or "")):
        return None  # (`\text{3 million}`, `\text{5 less than x}` are other answers than the number)
    return m.group(1)


_LATEX_COMMAND_RE = re.compile(r"\\[A-Za-z]+")
# LaTeX whose braces hold words that are markup, not prose: `\text{ degrees}`, `\begin{pmatrix}`
_LATEX_WORDS_RE = re.compile(rf"\\(?:{_TEXT_MACROS}|operatorname|begin|end)\s*\{{[^{{}}]*\}}")
_WORD_RE = re.compile(r"(?<![A-Za-z])[A-Za-z]{2,}")


def is_bare_math(text: str) -> bool:
    """Whether ``text`` is maths alone, no words (``\\sqrt{51}``, ``6 - 5i``, ``\\left( 3, \\pi \\right)``):
    such an ``<answer>`` span is read as a box is. A word of two letters or more outside LaTeX
    commands (``The answer is 72``, ``72 clips``) or an unclosed box is text to parse instead."""
    words = _LATEX_COMMAND_RE.sub(" ", _LATEX_WORDS_RE.sub(" ", text))
    return not _WORD_RE.search(words) and not _BOX_RE.search(text)


def has_expression(parsed: list | tuple) -> bool:
    """Whether a math-verify parse holds an expression (SymPy), not only the unparsed text."""
    return any(isinstance(p, (Basic, MatrixBase)) for p in parsed)


def _parse_pred(text: str, boxed: str | None = None) -> list:
    """``_parse_cached`` as a fresh list (math-verify's verify takes a list of alternatives)."""
    return list(_parse_cached(text, boxed))


# Evaluation parses each unboxed completion twice (its score, then the answer shown and voted on in
# maj@n): the second is a cache hit. Keys are capped by MathAccuracy.max_chars.
@lru_cache(maxsize=1024)
def _parse_cached(text: str, boxed: str | None) -> tuple:
    """Parse a prediction with math-verify's defaults (LaTeX with boxed priority, then plain
    expressions; rightmost match first). ``boxed`` is the (already normalised) box content that
    ``text`` re-boxes, or None when the completion has no box.

    math-verify 0.9 leaves some boxed contents as bare strings (``\\boxed{5\\%}`` → ``'5\\%'``)
    although the same content parses inside ``$...$`` (→ 5); so when such a box (a percent sign,
    ``\\text{}``-like units) gave no SymPy object, the ``$content$`` parses are added as further
    candidates (verify takes any match), and a box ending in sentence punctuation (``18.``, ``18,``)
    is parsed again without it. Only these: ``$5+$`` or ``$5 \\le$`` also parse to 5, and an
    unfinished box is not the number.
    A number in ``\\text{}`` with units (``\\text{18 dollars}``, a symbol ``18dollars`` to
    math-verify) adds ``$18$`` likewise. Without a box, the line after the last ``####`` is parsed
    first, since a GSM8K-style solution's ``$<<4+2=6.00>>6.00`` spans would otherwise outrank it.
    """
    if boxed is None:
        tail = hash_answer(text)
        if tail is not None:
            parsed = (math_verify.parse(tail, parsing_timeout=None)  # (`-$5`: math-verify reads nothing)
                      or math_verify.parse(tail.replace("\\$", "").replace("$", ""), parsing_timeout=None))
            if parsed:
                return tuple(parsed)
        return tuple(math_verify.parse(text, parsing_timeout=None))
    parsed = math_verify.parse(text, parsing_timeout=None)
    if not has_expression(parsed):
        if _LOOSE_BOX_RE.search(boxed):
            parsed = parsed + math_verify.parse(f"${boxed}$", parsing_timeout=None)
        bare = strip_end_punctuation(boxed)  # one sentence mark inside the box: `\boxed{18.}`
        if bare and bare != boxed:
            parsed = parsed + math_verify.parse("\\boxed{" + bare + "}", parsing_timeout=None)
    number = _text_number(boxed)
    if number is not None:
        parsed = parsed + math_verify.parse(f"${number}$", parsing_timeout=None)
    return tuple(parsed)
