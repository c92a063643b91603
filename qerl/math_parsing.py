"""math-verify parsing of gold answers and predictions, as ``qerl.rewards.MathAccuracy`` uses it.

math-verify 0.9 reads some common answer forms wrongly or not at all (``5\\,000`` as 0, ``5 dollars``
as a product of symbols, ``\\boxed{5\\%}`` as a string); the helpers here normalise or add
candidates for exactly those forms. Every function is pure; the caller bounds their run time.
"""

from __future__ import annotations

import re
from functools import lru_cache

import math_verify
from sympy import Basic, Integer, MatrixBase, Mul, Number, Rational, UnevaluatedExpr

from qerl.answers import _BOX_RE, hash_line_hedges, starts_with_relation  # noqa: F401 (re-exported)


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
_SIGNED_NUMBER = r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"  # (`1,250`, `-0.5`, `.5`: the number of a box with units)
_DOLLAR_BEFORE = r"(?:\\\$?\s*|\$\s*)?"  # (`\$18`, `$18`)
# A whole `\text{}`-unwrapped box that is one number, optionally followed by unit words.
_NUMBER_UNITS_RE = re.compile(rf"\s*({_DOLLAR_BEFORE}{_SIGNED_NUMBER})(?:\s+([A-Za-z][A-Za-z\s.]*))?")
# A box without LaTeX: one number, then words whose first has 3+ letters (`18 dollars`, `5 USD`;
# not `3 x`, `2 pi`, which are algebra) and none of which is maths or a magnitude (`2 sin x`,
# `4 factorial`, `3 million`, `5 less than x` are other answers than the number).
# (`[A-Za-z]{3}`, not `{3,}`, before the open class: a long word would split every way, quadratic)
_BARE_NUMBER_UNITS_RE = re.compile(rf"\s*({_SIGNED_NUMBER})\s+([A-Za-z]{{3}}[A-Za-z\s.]*)")
# A number with a unit symbol: a whitelisted abbreviation (`15 cm^2`, `20km/h`) or a unit word of 3+
# letters with a power or a rate (`864 inches^2`, `3 miles/hour`). Other 1- and 2-letter words stay algebra
# (`3 x^2`, `3 ab/c`); a one-letter unit only in a rate of units (`9.8 m/s^2`).
_UNIT_ABBREVIATIONS = "mm|cm|dm|km|ft|in|yd|mi|mg|kg|lb|lbs|oz|ml|mL|cc|hr|hrs|min|mph|kph|kmh|sq"
_UNIT_POWER = r"(?:\^\s*(?:\{\s*[23]\s*\}|[23]))?"
_UNIT = rf"(?:(?:{_UNIT_ABBREVIATIONS})(?![A-Za-z])|[A-Za-z]{{3,}}){_UNIT_POWER}"
_RATE_OF = rf"\s*/\s*(?:{_UNIT}|[smhgL](?![A-Za-z]){_UNIT_POWER})"
_NUMBER_UNIT_SYMBOL_RE = re.compile(
    rf"\s*({_DOLLAR_BEFORE}{_SIGNED_NUMBER})\s*"
    rf"({_UNIT}(?:\s+{_UNIT})*(?:{_RATE_OF})?|[mgL](?![A-Za-z]){_RATE_OF})\s*")
_NOT_UNITS = frozenset(
    "sin cos tan cot sec csc sinh cosh tanh arcsin arccos arctan log ln exp sqrt root roots factorial squared "
    "cubed power powers times plus minus over divided and or less more than fewer greater smaller hundred "
    "hundreds thousand thousands million millions billion billions trillion dozen dozens percent half halves "
    "third thirds quarter quarters pi".split()
    # nor a negation: `18 dollars is wrong`, `18 is not it` deny the number they hold
    + "not no nor never neither none wrong incorrect false".split())


# A degree sign, `°` or `\degree` (a `^` before it included), as MATH's golds write it: `^{\circ}`. math-verify
# 0.9 reads a box's `30°` as a string and `(3, 90°)` as 90 (its last number); `30^{\circ}` is 30, `(3, 90^{\circ})`
# the pair.
_DEGREE_RE = re.compile(r"(?:\^\s*)?(?:°|\\degree(?![A-Za-z]))")


def degrees_as_circ(text: str) -> str:
    """``text`` with each degree sign written ``^{\\circ}`` (``30°``, ``30\\degree`` → ``30^{\\circ}``)."""
    return _DEGREE_RE.sub(r"^{\\circ}", text)


# Boxes that math-verify 0.9 leaves as strings although their `$content$` is the number.
_LOOSE_BOX_RE = re.compile(rf"%|\\(?:{_TEXT_MACROS}|operatorname|unit)(?![a-z])")


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


# A bracket closed at an infinite end (`[-\infty, 3]`, `(2, \infty]`, `\infty \right]`): no interval, but sympy's
# Interval is open at ±∞ whatever the bracket, so math-verify matches it with the open one.
_CLOSED_AT_INFINITY_RE = re.compile(r"\[\s*[-+]?\s*(?:\\infty|∞)|(?:\\infty|∞)\s*(?:\\right\s*)?\]")


def closes_at_infinity(text: str) -> bool:
    """Whether ``text`` closes an interval at ``\\infty`` or ``-\\infty`` with a square bracket."""
    return _CLOSED_AT_INFINITY_RE.search(text) is not None


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


# A `####` line's values are told apart by a comma or semicolon outside brackets (not a thousands separator) or the
# word `and`; a part is a value if it holds a digit, a `\frac`, a fraction word (`72 and a half` is 72.5, not 72) or
# an ellipsis (`18, ...` is a sequence, as in a box).
_VALUE_SEPARATOR_RE = re.compile(r"\\[{}]|[([{)\]}]|[,;]|(?<![A-Za-z])and(?![A-Za-z])")
_VALUE_RE = re.compile(r"\d|\\[dt]?frac|\.\.\.|\u2026|\\[lc]?dots|(?<![A-Za-z])(?:an?|one|two|three)\s+"
                       r"(?:half|halves|thirds?|quarters?)(?![A-Za-z])", re.IGNORECASE)
_DECIMAL_COMMA_RE = re.compile(r"[-+]?\d+,\d{1,2}")  # `12,5`: one number to math-verify (12.5), as it was in 631ba22


def lists_several_values(line: str) -> bool:
    """Whether a cleaned ``####`` line (`qerl.answers.clean_hash_answer`) lists several values: ``16, 17, 18``,
    ``72; 73``, ``3 and 4``, ``72 and a half``, ``3 \\pm 2``. Not ``1,234`` (thousands), ``(1, 2)`` (one tuple),
    ``72 clips, which is the answer`` (one value) nor ``12,5`` (a decimal comma); ``18, ...`` (a sequence) is.
    Linear time."""
    if _PM_RE.search(line):
        return True
    if _DECIMAL_COMMA_RE.fullmatch(line):
        return False
    text = _THOUSANDS_COMMA_RE.sub("", line)
    depth, start, values = 0, 0, 0
    for m in _VALUE_SEPARATOR_RE.finditer(text):
        token = m.group()
        if token in ("(", "[", "{", "\\{"):
            depth += 1
        elif token in (")", "]", "}", "\\}"):
            depth -= 1
        elif depth <= 0:
            values += _VALUE_RE.search(text, start, m.start()) is not None
            start = m.end()
    return values + (_VALUE_RE.search(text, start) is not None) > 1


def _number_with_words(boxed: str) -> tuple[str, str] | None:
    """``\\text{18 dollars}``, ``18\\text{ dollars}`` or ``18 dollars`` → ``("18", "dollars")``: a box that, with
    ``\\text{}`` unwrapped, is one number plus words (``""`` for none: ``\\text{18}``) or a unit symbol (``15 cm^2``,
    ``20 km/h``: `_NUMBER_UNIT_SYMBOL_RE`); None for anything else (``\\text{Evelyn}``, ``2 and 3``, ``3 x^2``)."""
    boxed = _LATEX_SPACE_RE.sub(" ", boxed)  # (`15\,\text{cm}^2`, `15 \, cm^2`)
    if "\\" not in boxed:
        m = _BARE_NUMBER_UNITS_RE.fullmatch(boxed) or _NUMBER_UNIT_SYMBOL_RE.fullmatch(boxed)
        return (m.group(1), m.group(2)) if m is not None else None
    unwrapped = _TEXT_RE.sub(r"\1", boxed)
    if unwrapped == boxed:
        return None
    m = _NUMBER_UNITS_RE.fullmatch(unwrapped) or _NUMBER_UNIT_SYMBOL_RE.fullmatch(unwrapped)
    return (m.group(1), m.group(2) or "") if m is not None else None


def _words_change_the_number(words: str) -> bool:
    """Whether the words after a number make it another answer (``3 million``, ``5 less than x``, ``2 pi``) or
    no answer (``18 is wrong``, ``17 or more``; `qerl.answers.hash_line_hedges`), rather than its units."""
    return hash_line_hedges(words) or any(w.lower() in _NOT_UNITS for w in re.findall(r"[A-Za-z]+", words))


def _text_number(boxed: str) -> str | None:
    """``\\text{18 dollars}`` or ``18 dollars`` → ``18``: the number of a box that, with ``\\text{}``
    unwrapped, is one number plus unit words; None for anything else (``\\text{Evelyn}``, ``2 and 3``,
    ``\\text{3 million}``, ``18\\text{ is wrong}``: other answers than the number, or none)."""
    found = _number_with_words(boxed)
    return found[0] if found is not None and not _words_change_the_number(found[1]) else None


_LATEX_COMMAND_RE = re.compile(r"\\[A-Za-z]+")
# LaTeX whose braces hold words that are markup, not prose: `\text{ degrees}`, `\begin{pmatrix}`
_LATEX_WORDS_RE = re.compile(rf"\\(?:{_TEXT_MACROS}|operatorname|begin|end)\s*\{{[^{{}}]*\}}")
_WORD_RE = re.compile(r"(?<![A-Za-z])[A-Za-z]{2,}")
# Two numbers with words between them (commands aside): `2 hours and 30 minutes`, `5 feet 6 inches`.
_WORDS_BETWEEN_NUMBERS_RE = re.compile(r"\d\s*[A-Za-z][A-Za-z\s,;]*\d")
_LATEX_SPACE_RE = re.compile(r"\\[,;:! ]|\\q?quad(?![A-Za-z])|~")  # LaTeX spacing: a blank


def _is_compound_quantity(boxed: str) -> bool:
    """Whether a box holds two numbers with ``\\text{}`` words between them (``2\\text{ hours and }30\\text{ minutes}``,
    ``5 \\text{ feet } 6 \\text{ inches}``): a quantity in mixed units, which math-verify reads as its first number."""
    unwrapped = _TEXT_RE.sub(r" \1 ", boxed)
    spaced = _LATEX_SPACE_RE.sub(" ", unwrapped)  # (`2\,\text{h}\,30\,\text{min}`, `\quad`)
    return unwrapped != boxed and _WORDS_BETWEEN_NUMBERS_RE.search(_LATEX_COMMAND_RE.sub("#", spaced)) is not None


def is_bare_math(text: str) -> bool:
    """Whether ``text`` is maths alone, no words (``\\sqrt{51}``, ``6 - 5i``, ``\\left( 3, \\pi \\right)``):
    such an ``<answer>`` span is read as a box is. A word of two letters or more outside LaTeX
    commands (``The answer is 72``, ``72 clips``) or an unclosed box is text to parse instead."""
    words = _LATEX_COMMAND_RE.sub(" ", _LATEX_WORDS_RE.sub(" ", text))
    return not _WORD_RE.search(words) and not _BOX_RE.search(text)


_DECIMALS_RE = re.compile(r"(?<![\d.])\d*\.(\d+)")
DEFAULT_FLOAT_ROUNDING = 6  # math-verify's: `1/3` matches `0.333333`


def float_rounding(*answers: str) -> int:
    """The decimal places math-verify rounds floats to before comparing them: its default (6), or more when
    the gold or the answer is written with more (``.0000672``: 7), so that ``0.0000673`` is not ``.0000672``
    and ``0.0000014`` not ``0.000001``. A number's places beyond 6 are then compared as written."""
    places = [len(m) for a in answers for m in _DECIMALS_RE.findall(a[:1000])]
    return max([DEFAULT_FLOAT_ROUNDING, *places])


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
    A number with unit words (``18 dollars``, ``\\text{18 dollars}``: products of symbols to math-verify, and
    ~8 ms to parse) is read as ``$18$`` alone, and a number with a percent sign (``12.5\\%``) adds the number:
    math-verify matches ``9\\%`` with 9 (integers) but reads ``12.5\\%`` only as 0.125, which the docstring of
    `qerl.rewards.MathAccuracy` promises to match with 12.5 as ``5\\%`` is with 5 (0.125 still matches too).
    A ``####`` line comes here boxed when it is maths alone (`parse_hash_line`). Without a box, when the
    expression math-verify takes from the text (its last string) is a number with unit words
    (``\\[ 18 \\text{ dollars} \\]``, ``18*dollars`` to math-verify), that number is a candidate too, put first so
    that the answer shown (`qerl.rewards.MathAccuracy.scored_answer`) is still math-verify's string.
    """
    if boxed is None:
        parsed = tuple(math_verify.parse(text, parsing_timeout=None))
        strings = [p for p in parsed if isinstance(p, str)]
        number = _text_number(strings[-1].strip()) if strings else None
        return parsed if number is None else tuple(math_verify.parse(f"${number}$", parsing_timeout=None)) + parsed
    found = _number_with_words(boxed)
    if found is not None:  # math-verify would keep the number of `70\text{ thousand}` or `18\text{ is wrong}` too
        if _words_change_the_number(found[1]):
            return ()
        return tuple(math_verify.parse(f"${found[0]}$", parsing_timeout=None))
    parsed = math_verify.parse(text, parsing_timeout=None)
    if not has_expression(parsed):
        if _LOOSE_BOX_RE.search(boxed):
            parsed = parsed + math_verify.parse(f"${boxed}$", parsing_timeout=None)
        bare = strip_end_punctuation(boxed)  # one sentence mark inside the box: `\boxed{18.}`
        if bare and bare != boxed:
            parsed = parsed + math_verify.parse("\\boxed{" + bare + "}", parsing_timeout=None)
    if any(isinstance(p, Number) for p in parsed) and _is_compound_quantity(boxed):
        return ()  # `2 hours and 30 minutes` is not 2 (a list, `3 \text{ and } 4`, is read as one)
    number = _percent_number(boxed)
    if number is not None:
        parsed = parsed + math_verify.parse(f"${number}$", parsing_timeout=None)
    return tuple(parsed)


_PERCENT_NUMBER_RE = re.compile(rf"\s*({_SIGNED_NUMBER})[ \t]*\\?%\s*")
_LOOSE_LETTERS_RE = re.compile(r"[A-Za-z]{2}|(?<=\s)[A-Za-z]")  # a word, or a letter after a blank


def _percent_number(boxed: str) -> str | None:
    """``12.5\\%``, ``12.5%``, ``12.5 \\%`` → ``12.5``; None for anything else."""
    m = _PERCENT_NUMBER_RE.fullmatch(boxed)
    return m.group(1) if m is not None else None


_PERCENT = UnevaluatedExpr(Rational(1, 100))  # latex2sympy's `%`: `2500\%` is 2500 * (1/100), `-5\%` -1 * 5 * (1/100)


def percents_as_numbers(pred: list, gold: list | tuple) -> list:
    """``pred`` with each percentage as its number (``2500\\%`` → 2500) when the gold is an integer (a count, or a
    percent given as its number): math-verify matches ``25\\%`` with 25, and also ``2500\\%``, which is 25 only as a
    fraction -- a slip by a factor of 100. Other golds keep both readings (``12.5\\%`` is 0.125 and 12.5)."""
    if not any(isinstance(g, Integer) for g in gold):
        return pred
    return [Mul(*(a for a in p.args if a != _PERCENT)) if isinstance(p, Mul) and p.args.count(_PERCENT) == 1 else p
            for p in pred]


def _has_loose_letters(line: str) -> bool:
    """Whether ``line`` has letters outside LaTeX commands and ``\\text{}`` that are no algebra: a word
    (``clips``, ``cm²``) or a letter after a blank (``12 m/s``, ``12 x``), not ``3x`` or ``e^2``."""
    return _LOOSE_LETTERS_RE.search(_LATEX_COMMAND_RE.sub(" ", _LATEX_WORDS_RE.sub(" ", line))) is not None


@lru_cache(maxsize=1024)
def parse_hash_line(line: str) -> tuple[tuple, str]:
    """A cleaned ``####`` answer line's candidates for ``math_verify.verify`` (it accepts a match with any) and
    the answer they show (reports, maj@n votes).

    Two readings. As a box (``\\boxed{line}``, `_parse_cached`) when the line is maths alone or a list: ``-.5``,
    ``\\dfrac12``, ``5:30``, ``3, 4`` parse there and not as text. As text, math-verify's plain parse (its last
    number: how 631ba22 read every line) when the box reading is not the whole answer: words or units after
    the value (``72 clips!``, ``3 days = 72 hours``, ``12 m/s``, ``1/2 cup``), symbols math-verify's LaTeX leaves
    as a string (``72 €``, ``-5°``) or a decimal comma (``12,5``). A line of maths alone is not read as text:
    there the plain parse takes a number out of it (``2^{10}``, ``2\\sqrt{3}``, ``10^{100}`` as 2, 2, 10), nor is
    a line that ends in an ellipsis (``0.33...`` is 1/3, not 0.33; `qerl.answers.strip_trailing_marks` kept it)."""
    boxed = _parse_cached("\\boxed{" + line + "}", line) if is_bare_math(line) or lists_several_values(line) else ()
    decimal_comma = _DECIMAL_COMMA_RE.fullmatch(line) is not None
    maths_alone = has_expression(boxed) and not decimal_comma and not _has_loose_letters(line)
    if maths_alone or line.endswith(("...", "\u2026")):
        return boxed, line
    plain = tuple(math_verify.parse(line, parsing_timeout=None))
    strings = [p for p in plain if isinstance(p, str)]
    # shown: the plain reading (`72 clips` → 72), unless a list or a decimal comma, whose plain reading is not it
    whole = decimal_comma or not strings or lists_several_values(line)
    return boxed + plain, line if whole else strings[-1]
