"""Answer extraction: pure string functions, linear time, never raising.

Shared by the data pipeline (gold answers: GSM8K ``####``, MATH ``\\boxed{}`` in a solution) and
the rewards (the model's boxed answer; a best-effort answer for logging tables).
"""

from __future__ import annotations

import re
import sys
import unicodedata

# Optional whitespace is legal LaTeX (`\boxed {5}`); `\fbox` is what some models emit instead.
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
# GSM8K's answer marker, one line after `####`: `18`, `$1,234`, `-0.5`, `\frac{1}{2}`, `18 dollars`, also
# through emphasis (`**18**`) and an `Answer:` prefix; `x = 18` only when nothing follows the value.
# A markdown heading (`Step 2: Money`, `1. Setup`, `3) Result`) or `n = 3 apples per box` is not one; a line
# that starts with a relation (`#### \neq 18`, `#### > 18`) is, so that the reward can refuse it as it does a box.
_HASH_LINE_RE = re.compile(r"####([^\n]*)")
# a relation or negation with nothing on its left: `\neq 72`, `\geq 5`, `\nleq 5`, `\notin A`, `> 3`,
# `{\ge} 5`, `≤ 4`; not GSM8K's `<<2*9=18>>` calculator markup nor an angle-bracket vector `<1, 2>`.
# (`\s*(?:\{\s*)?`, not `\s*\{?\s*`: two whitespace runs side by side backtracked quadratically, 8 s on 40k spaces)
_LEADING_RELATION_RE = re.compile(
    r"^\s*(?:\{\s*)?(?:\\(?:n?[lg]eq?q?|n?[lg]eqslant|[lg]neq?q?|[lg]t|ll|gg|ne|neq|not[a-z]*|neg|lnot|nless|ngtr)"
    r"(?![A-Za-z])|[≠≤≥≮≯≰≱⩽⩾]|!=|>|<(?![<])(?![^<>]*>\s*$))")
# `$-5`, `-$5`, `\$ 5`, `- 5`; no two `[ \t]*` side by side (with the sign optional between them a
# run of spaces split every way: quadratic backtracking, 51 s on 20k spaces, past any deadline)
_SIGN_AND_DOLLAR = r"(?:\\?\$[ \t]*)?(?:[-+][ \t]*)?(?:\\?\$[ \t]*)?"
_STARTS_LIKE_ANSWER_RE = re.compile(_SIGN_AND_DOLLAR + r"(?:\.?\d|\\[dt]?frac)")
_NUMBERED_HEADING_RE = re.compile(r"\d+[.):][ \t]*[a-z]", re.IGNORECASE)
_ANSWER_PREFIX_RE = re.compile(r"(?:final[ \t]+)?answer[ \t]*(?:is)?[ \t]*:?", re.IGNORECASE)
_VARIABLE_PREFIX_RE = re.compile(r"[a-z][ \t]*=", re.IGNORECASE)
_LONE_VALUE_RE = re.compile(_SIGN_AND_DOLLAR + r"(?:\d[\d,]*(?:\.\d+)?|\.\d+|\\[dt]?frac\{[^{}]*\}\{[^{}]*\})"
                            r"(?:[ \t]*\\?%)?[ \t]*\.?")
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:)\s*:?\s*([^\n]*)", re.IGNORECASE)
_PLAIN_NUMBER_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
# Minus signs other than ASCII '-' (math-verify and the regexes above read `−5` as 5 outside LaTeX):
# the maths minus U+2212 and the small / fullwidth hyphen-minus anywhere; the figure, en and em dashes
# and the horizontal bar only as a sign -- before a digit and not after a letter, digit, bracket or
# point, where `3–5` is a range and `answer—5` punctuation.
_MINUS_RE = re.compile("[\u2212\ufe63\uff0d]|(?<![\\w)\\]}.,])[\u2012-\u2015](?=\\d)")
# A decimal digit other than 0-9 (`\d` of a str pattern is Unicode category Nd, what str.isdecimal
# accepts: fullwidth `１２`, Arabic-Indic `٧٢`, Devanagari `७२`...). Not NFKC, which would also
# turn superscripts (`x²`) and circled or fraction forms into plain digits: other answers.
_NON_ASCII_DIGIT_RE = re.compile(r"[^\D0-9]")
# Zero-width space, non-joiner, joiner, word joiner and BOM: invisible, but they split a number
# (`1\u200b2` is two numbers to math-verify); deleted, never replaced by a space.
_ZERO_WIDTH = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff"))
_ZERO_WIDTH_RE = re.compile("[\u200b\u200c\u200d\u2060\ufeff]")
# The Arabic decimal and thousands separators (U+066B, U+066C) between two digits: `٣٫٥` is 3.5 and
# `١٬٠٠٠` is 1,000 (elsewhere they are left alone).
_ARABIC_SEPARATOR_RE = re.compile("(?<=[0-9])[\u066b\u066c](?=[0-9])")


def _boxed_spans(text: str) -> list[tuple[int, int]]:
    """Return ``(content_start, content_end)`` of every closed ``\\boxed{...}``/``\\fbox{...}``.

    Brace matching is done once for the whole string with a stack, so adversarial input such as
    thousands of unclosed ``\\boxed{`` stays O(n) instead of rescanning from every occurrence.
    Escaped braces (``\\{``) are skipped so set notation inside a box does not unbalance it.
    """
    match_of: dict[int, int] = {}
    stack: list[int] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character (\{, \}, \\)
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            match_of[stack.pop()] = i
        i += 1
    spans = []
    for m in _BOX_RE.finditer(text):
        open_pos = m.end() - 1
        close_pos = match_of.get(open_pos)
        if close_pos is not None:
            spans.append((open_pos + 1, close_pos))
    return spans


def extract_boxed(text: str) -> str | None:
    """Content of the last closed ``\\boxed{...}`` (or ``\\fbox{...}``), stripped; None if absent.

    Braces are balanced, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. "Last" means the box
    that closes last (as math-verify orders matches), so for nested boxes the outer one wins and
    an unclosed trailing ``\\boxed{`` (a truncated completion) is ignored in favour of the last
    complete box. The space form ``\\boxed 5`` is not supported.
    """
    if not isinstance(text, str):
        return None
    spans = _boxed_spans(text)
    if not spans:
        return None
    start, end = max(spans, key=lambda s: s[1])
    return text[start:end].strip()


def boxed_answers(text: str) -> list[str]:
    """Contents of every outermost closed box, stripped, in order, without repeats or empty ones:
    a multi-answer solution's boxes (``x = \\boxed{1}`` and ``x = \\boxed{-2}`` → ``['1', '-2']``)."""
    if not isinstance(text, str):
        return []
    # Balanced spans nest or are disjoint: by start, a span is outermost iff it ends after every
    # outermost one before it (one pass; comparing all pairs was quadratic in thousands of boxes).
    outer, reach = [], -1
    for start, end in sorted(_boxed_spans(text)):
        if end > reach:
            outer.append((start, end))
            reach = end
    answers: list[str] = []
    seen: set[str] = set()
    for start, end in outer:  # disjoint: in start order is in end order
        content = text[start:end].strip()
        if content and content not in seen:
            seen.add(content)
            answers.append(content)
    return answers


def unwrap_emphasis(text: str) -> str:
    """``text`` stripped of blanks and markdown emphasis around it (``**72**`` → ``72``)."""
    return text.strip().strip("*_").strip()


def answer_tag_content(text: str) -> str | None:
    """The content of the last closed ``<answer>...</answer>`` (R1-style tags), or None (linear time)."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end >= 0 else -1
    return text[start + len("<answer>"):end] if start >= 0 else None


def starts_with_relation(text: str) -> bool:
    """Whether ``text`` starts with a relation or negation that has no left side (``\\neq 72``, ``> 72``,
    ``\\geq 5``, ``\\nleq 5``, ``\\neg 72``): an answer that is *not* its number, which math-verify
    would still read as that number. ``\\approx 72`` is not one (approximately 72 is 72), nor
    ``x > 72``, GSM8K's ``<<2*9=18>>18`` or a vector ``<1, 2, 3>``. An opening ``$`` is skipped (``$\\geq 18$``)."""
    return bool(_LEADING_RELATION_RE.match(text.lstrip().removeprefix("$")))


def hash_answer(text: str) -> str | None:
    """The line after the last ``####`` that reads as an answer (it starts with a number, ``$`` or a
    fraction, after emphasis and an ``Answer:`` prefix; ``x = 18`` when only the value follows),
    stripped; None when there is none. A markdown heading (``#### Step 2``, ``#### 1. Setup``) is not.
    A line that starts with a relation (``#### \\neq 18``) is returned too: it is an answer, a wrong one
    (``MathAccuracy`` refuses it as it refuses ``\\boxed{\\neq 18}``), not a line to skip for an earlier one."""
    if not isinstance(text, str) or "####" not in text:
        return None
    for line in reversed(_HASH_LINE_RE.findall(text)):  # the last answer line wins (self-corrections)
        line = unwrap_emphasis(line)
        prefix = _ANSWER_PREFIX_RE.match(line)
        if prefix:
            line = unwrap_emphasis(line[prefix.end():])
        elif (variable := _VARIABLE_PREFIX_RE.match(line)) is not None:
            value = unwrap_emphasis(line[variable.end():])
            if _LONE_VALUE_RE.fullmatch(value):
                return value
            continue
        if _STARTS_LIKE_ANSWER_RE.match(line) and not _NUMBERED_HEADING_RE.match(line):
            return line
        if starts_with_relation(line):
            return line
    return None


# A sign then a dollar, spaces around either (`-$5`, `- \$ 5`): the sign is the number's. One space run on each
# side of the mandatory `$` (no two optional runs side by side: see `_SIGN_AND_DOLLAR`).
_SIGN_THEN_DOLLAR_RE = re.compile(r"([-+])[ \t]*\\?\$[ \t]*")
# in running text: a minus that opens a dollar amount (`lost -$3`, `is - \$3`), not one after a value (`$10-$3`)
_MINUS_THEN_DOLLAR_RE = re.compile(r"(?<![\w)\]}$.])-[ \t]*\\?\$[ \t]*(?=\d)")
_SIGN_THEN_SPACE_RE = re.compile(r"([-+])[ \t]+")  # `- 5`: a sign apart from its number
# Markdown emphasis inside the line (`**18** dollars`, `18 **dollars**`): a `**`/`__` after the start, a blank or an
# opening bracket, or before the end, a blank, a closing bracket or a sentence mark; `2**10` (a power) is left alone.
_EMPHASIS_RE = re.compile(r"(?<![^\s(\[])(?:\*\*|__)|(?:\*\*|__)(?![^\s.,;:!?)\]])")
_EMOTICONS = (":)", ":-)", ":(", ":-(", ";)", ";-)", ":D", ":-D", ":P", ":p", "=)")
# Words that deny or hedge a `####` line's value (`71 or 72`, `72 is not correct`, `17 (not 18)`, `18 dollars is
# wrong`, `isn't`): math-verify would still read the line's last number. A deny-list of its own, not
# `math_parsing._NOT_UNITS`, whose trig, comparison and magnitude words (`18 sec`, `3 more`, `5 times`) follow
# real GSM8K answers, which 631ba22 scored by their number.
_HEDGE_RE = re.compile(r"(?<![A-Za-z])(?:or|nor|not|never|neither|wrong|incorrect|false|maybe|perhaps|possibly|unsure)"
                       r"(?![A-Za-z])|n['\u2019]t(?![A-Za-z])", re.IGNORECASE)


def _trailing_mark(line: str, end: int) -> int:
    """The length of the punctuation that ``line[:end]`` ends with (`strip_trailing_marks`), 0 for none."""
    for emoticon in _EMOTICONS:
        start = end - len(emoticon)
        if line.endswith(emoticon, 0, end) and start > 0 and line[start - 1].isspace():
            return len(emoticon)
    dots = 3 if line.endswith("...", 0, end) else 1 if line.endswith("\u2026", 0, end) else 0
    if dots:  # after a blank, not after a comma: `18 ...` (not `0.33...`, 1/3, nor `18, ...`, a sequence)
        blank = end - dots
        while blank and line[blank - 1].isspace():
            blank -= 1
        return dots if blank < end - dots and blank and line[blank - 1] != "," else 0
    return 1 if end and line[end - 1] in ".,;:!?" else 0


def strip_trailing_marks(line: str) -> str:
    """``line`` without the punctuation after its answer, blanks included: sentence marks (``72?``, ``72 clips!``,
    ``18,``, ``1,234,``, ``18.``), an ellipsis after a blank (``18 ...``) and an emoticon after a blank (``72 :)``).
    An ellipsis right after a digit or a comma stays (``0.33...`` is 1/3, ``18, ...`` a sequence), as in a box
    (`qerl.math_parsing.strip_end_punctuation`). Linear: a backward scan (each blank is read at most twice)."""
    end = len(line)
    while True:
        cut = end
        while cut and line[cut - 1].isspace():
            cut -= 1
        mark = _trailing_mark(line, cut)
        if not mark:
            return line[:cut]
        end = cut - mark


def final_hash_line(text: str) -> str | None:
    """The line after the last ``####`` when it ends the text (only blanks after it), stripped; else None.
    Unlike `hash_answer` it may start with a word (``#### It is 72``): the last thing the completion says."""
    start = text.rfind("####")
    if start < 0:
        return None
    line, _, after = text[start + 4:].partition("\n")
    return line.strip() if not after.strip() else None


def hash_line_hedges(line: str) -> bool:
    """Whether a ``####`` answer line denies or hedges its value (``71 or 72``, ``18 is not right``, ``17 (not
    18)``, ``18 dollars is wrong``): such a line answers nothing (see `_HEDGE_RE`)."""
    return _HEDGE_RE.search(line) is not None


def clean_hash_answer(line: str) -> str:
    """A ``####`` answer line (`hash_answer`) with what is no part of its value removed: markdown emphasis
    (``**18** dollars``), ``$`` and ``\\$`` (math-verify reads ``-$5`` as nothing), trailing sentence marks,
    ellipsis and emoticons (`strip_trailing_marks`: ``72?``, ``18,``, ``72 :)``), and a sign joined to its number
    (``- 5``, ``-$5`` → ``-5``; ``+3`` → ``3``). Linear time."""
    line = _EMPHASIS_RE.sub("", line).replace("\\$", "").replace("$", "")
    line = strip_trailing_marks(line).strip()
    sign = _SIGN_THEN_SPACE_RE.match(line)
    if sign is not None:
        line = sign.group(1) + line[sign.end():]
    if line.startswith("+"):  # (a plus sign says nothing; `\boxed{+3}` only happens to read as 3)
        line = line[1:].lstrip()
    return line


def minus_before_dollar(text: str) -> str:
    """``text`` with a negative dollar amount written as its number (``The answer is -$3.`` → ``-3.``):
    math-verify reads ``-$3`` as nothing (the ``$`` opens maths), so an unboxed answer of -3 was no answer."""
    return _MINUS_THEN_DOLLAR_RE.sub("-", text)


def normalize_minus(text: str) -> str:
    """``text`` with Unicode minus signs written as ``-`` (``#### −5`` → ``#### -5``; see `_MINUS_RE`)."""
    return _MINUS_RE.sub("-", text)


def normalize_digits(text: str) -> str:
    """``text`` with every Unicode decimal digit written as its ASCII digit (``\\boxed{１２}``,
    ``٧٢``, ``७२`` → ``12``, ``72``, ``72``), the Arabic decimal / thousands separators between digits
    as ``.`` / ``,`` (``٣٫٥`` → ``3.5``) and zero-width characters deleted (``1\\u200b2`` → ``12``):
    math-verify and the regexes here read only ASCII digits. Superscripts and other digit-like
    symbols stay as they are (see `_NON_ASCII_DIGIT_RE`). Linear time; ASCII text is returned as is."""
    if text.isascii():
        return text
    if _ZERO_WIDTH_RE.search(text):  # (translate() over the whole text is the slow part: only when needed)
        text = text.translate(_ZERO_WIDTH)
    text = _NON_ASCII_DIGIT_RE.sub(lambda m: str(unicodedata.decimal(m.group(), m.group())), text)
    return _ARABIC_SEPARATOR_RE.sub(lambda m: "." if m.group() == "\u066b" else ",", text)


def extract_gsm8k_gold(answer_field: str) -> str:
    """Gold answer of a GSM8K ``answer`` field: text after the last ``####``.

    ``$`` and a final period are stripped, and a number loses its thousands separators
    (``#### 1,000`` → ``1000``); other commas stay (``#### 3, 4``, an interval ``(1,2)``). A field
    without ``####`` is treated as the bare answer (short-answer sets: AMC, AIME) and cleaned the same way.
    """
    text = answer_field.rsplit("####", 1)[-1] if "####" in answer_field else answer_field
    return clean_short_answer(text)


def clean_short_answer(text: str) -> str:
    """Strip math delimiters and sentence punctuation around a one-line answer; a plain number
    loses its thousands separators (``1,000`` → ``1000``) as in `extract_gsm8k_gold`. A leading sign with
    a dollar is the sign alone (``-$5``, ``- \\$ 5``, ``−$5`` → ``-5``): stripping ``$`` only at the ends
    left ``-$5``, a gold that math-verify reads as nothing, so no answer could match it."""
    text = text.strip().strip("$").strip()
    text = text.rstrip(".").strip().strip("$").strip()
    signed = _SIGN_THEN_DOLLAR_RE.match(normalize_minus(text[:1]) + text[1:])  # (`−`: U+2212 and the like)
    if signed is not None:
        text = signed.group(1) + text[signed.end():]
    return text.replace(",", "") if _PLAIN_NUMBER_RE.fullmatch(text) else text


def _clean_emphasised(text: str) -> str:
    """`clean_short_answer` of ``text`` without markdown emphasis (``** 18``, ``**18**.`` → ``18``), as
    `hash_answer` reads a ``####`` line."""
    return clean_short_answer(unwrap_emphasis(_EMPHASIS_RE.sub("", text)))


def extract_answer(completion: str) -> str | None:
    """Best-effort answer string of a completion, for logging tables (not used for scoring).

    Order (first hit wins): 1) last ``\\boxed{}``/``\\fbox{}``; 2) the last ``<answer>...</answer>``,
    else the answer after the last ``####``; 3) text after the last "answer is"/"answer:"; 4) the
    last number in the text (commas removed). Returns None if none applies.
    """
    if not isinstance(completion, str) or not completion:
        return None
    completion = normalize_digits(completion)  # as MathAccuracy reads every completion
    boxed = extract_boxed(completion)
    if boxed is not None:
        return boxed
    completion = normalize_minus(completion)  # as MathAccuracy reads a completion without a box
    tagged = answer_tag_content(completion)
    if tagged and _clean_emphasised(tagged):
        return _clean_emphasised(tagged)
    hashed = hash_answer(completion)
    if hashed and clean_short_answer(hashed):
        return clean_short_answer(hashed)
    hits = _ANSWER_IS_RE.findall(completion)  # (`**Answer:** 18`: the text after the colon is `** 18`)
    if hits and _clean_emphasised(hits[-1]):
        return _clean_emphasised(hits[-1])
    numbers = _NUMBER_RE.findall(completion)
    return numbers[-1].replace(",", "") if numbers else None


# An integer as a gold or a box holds it: digits, optionally signed, optionally in groups of three
# separated by commas (`1,000,000`).
_INTEGER_RE = re.compile(r"([-+]?)(\d{1,3}(?:,\d{3})+|\d+)")


def is_long_integer(text: str) -> bool:
    """Whether ``text`` is a plain integer with more digits than Python's ``int()`` converts
    (``sys.get_int_max_str_digits()``, 4300 by default): math-verify fails on it."""
    limit = sys.get_int_max_str_digits()
    m = _INTEGER_RE.fullmatch(text)
    return bool(limit) and m is not None and len(m.group(2).replace(",", "")) > limit


def long_integers_equal(gold: str, pred: str | None) -> bool | None:
    """Whether two plain integers are equal, compared as digit strings (sign, leading zeros and
    thousands commas normalised), when either is too long for ``int()`` (:func:`is_long_integer`);
    None when math-verify should decide (both short, or either not a plain integer). Raising the limit
    instead would let a completion's long number cost quadratic time in ``int()``; this is linear."""
    pred = pred.strip() if pred is not None else None
    if not (is_long_integer(gold) or (pred is not None and is_long_integer(pred))):
        return None
    g, p = _INTEGER_RE.fullmatch(gold), _INTEGER_RE.fullmatch(pred) if pred is not None else None
    if g is None or p is None:
        return None

    def canonical(m: re.Match) -> str:
        digits = m.group(2).replace(",", "").lstrip("0") or "0"
        return digits if digits == "0" or m.group(1) != "-" else "-" + digits

    return canonical(g) == canonical(p)
