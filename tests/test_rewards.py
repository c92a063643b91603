"""Tests for qerl.rewards: gold parsing, boxed extraction, math-verify accuracy, format,
weighted sums, and robustness (bounded time, never raising) on adversarial model output.

Rows below are copied from GSM8K test / MATH500 (CI has no /work/shared data directory).
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import pytest

import qerl.reward_function as reward_function
import qerl.rewards as rewards_module
from qerl.rewards import (
    FormatReward,
    MathAccuracy,
    RewardFunction,
    WeightedSum,
    extract_answer,
    extract_boxed,
    extract_gsm8k_gold,
)

# First rows of gsm8k/test.jsonl ("answer" field) and math500/test.jsonl ("solution", "answer").
GSM8K_ROWS = [
    (
        "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
        "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer\u2019s market.\n#### 18",
        "18",
    ),
    ("It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total amount of fabric is 2+1=<<2+1=3>>3 bolts of fabric\n#### 3", "3"),
    ("So the house is worth 80,000+150,000=$<<80000+150000=230000>>230,000\n#### 70,000", "70000"),
    ("He spent $<<5*2=10>>10.\n#### $1,450,000 ", "1450000"),
]
MATH_ROWS = [
    (
        r"Therefore, the polar coordinates are $\boxed{\left( 3, \frac{\pi}{2} \right)}.$",
        r"\left( 3, \frac{\pi}{2} \right)",
    ),
    (r"So the sum is $\boxed{p - q}.$", "p - q"),
    (r"Hence $f(-2) + f(-1) + f(0) = \boxed{\frac{14}{3}}.$", r"\frac{14}{3}"),
    (r"The answer is $\boxed{\text{Evelyn}}$.", r"\text{Evelyn}"),
    (r"so the answer is $\boxed{90^\circ}$.", r"90^\circ"),
    (r"which gives $\boxed{\begin{pmatrix} -1/3 \\ 2/3 \\ 5/3 \end{pmatrix}}.$", r"\begin{pmatrix} -1/3 \\ 2/3 \\ 5/3 \end{pmatrix}"),
    (r"The total is $\boxed{\$18.90}$.", r"\$18.90"),
    (r"So there are $\boxed{10,\!080}$ ways.", r"10,\!080"),
    (r"The solution set is $\boxed{(-\infty, 2) \cup (3, \infty)}$.", r"(-\infty, 2) \cup (3, \infty)"),
]


@pytest.fixture(scope="module")
def acc() -> MathAccuracy:
    return MathAccuracy(timeout_s=1.0)


# ---------------------------------------------------------------- extraction


@pytest.mark.parametrize("field,gold", GSM8K_ROWS)
def test_gsm8k_gold(field: str, gold: str) -> None:
    assert extract_gsm8k_gold(field) == gold


def test_gsm8k_gold_without_marker() -> None:
    assert extract_gsm8k_gold(" $1,000 ") == "1000"


@pytest.mark.parametrize("solution,answer", MATH_ROWS)
def test_extract_boxed_real_math_solutions(solution: str, answer: str) -> None:
    assert extract_boxed(solution) == answer


@pytest.mark.parametrize(
    "text,expected",
    [
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"first \boxed{1} then \boxed{2}", "2"),  # last box wins
        (r"\boxed{a} \boxed{\boxed{b}}", r"\boxed{b}"),  # outer box of the last nest
        (r"\boxed{5} and then \boxed{", "5"),  # unclosed trailing box is ignored
        (r"\fbox{7}", "7"),
        (r"\boxed {  8 }", "8"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not unbalance
        (r"\boxed{x^{2^{3}}}", "x^{2^{3}}"),
        ("no box here 42", None),
        (r"\boxed{", None),
        ("", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        (r"so $\boxed{12}$. #### 13", "12"),  # boxed first
        ("work...\n#### 1,600", "1600"),
        ("Thus the answer is $5$.", "5"),
        ("The final answer: 3/4", "3/4"),
        ("I get 12 apples, then 1,234.5 pears", "1234.5"),
        ("no digits at all", None),
        ("", None),
        ("#### Step 1: eggs\n#### Step 2: money\nThe answer is 18.", "18"),  # headings are not answers
        ("#### 18\n#### Check", "18"),
        ("She earns 9 * 2 dollars.\n**Answer:** 18", "18"),  # markdown emphasis is no part of it (was `** 18`)
        ("The answer is **18**.", "18"),
        ("<answer>**18**</answer>", "18"),
    ],
)
def test_extract_answer_order(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


# ---------------------------------------------------------------- accuracy


@pytest.mark.parametrize(
    "completion,gold",
    [
        (r"So $\boxed{\frac{1}{2}}$.", "0.5"),
        (r"\boxed{\frac{1}{2}}", r"\frac12"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{1/2}", "0.5"),
        (r"\boxed{1,000}", "1000"),
        (r"\boxed{\$5}", "5"),
        ("The total is $5. \\boxed{$5$}", "5"),
        (r"\boxed{5\%}", "5"),
        (r"\boxed{5\%}", r"5\%"),
        (r"\boxed{\dfrac{14}{3}}", r"\frac{14}{3}"),
        (r"\boxed{\frac{\pi}{2}+3}", r"3+\frac{\pi}{2}"),
    ],
)
def test_accuracy_equivalences(acc: MathAccuracy, completion: str, gold: str) -> None:
    assert acc([completion], [gold]) == [1.0]


@pytest.mark.parametrize("solution,answer", MATH_ROWS)
def test_accuracy_real_math_rows(acc: MathAccuracy, solution: str, answer: str) -> None:
    assert acc([solution], [answer]) == [1.0]


@pytest.mark.parametrize("field,gold", GSM8K_ROWS)
def test_accuracy_gsm8k_style(acc: MathAccuracy, field: str, gold: str) -> None:
    assert acc([f"... so she makes \\boxed{{{gold}}} dollars."], [gold]) == [1.0]
    # Without a box the fallback parses the line after the last "####".
    assert acc([field], [gold]) == [1.0]
    assert MathAccuracy(boxed_only=True)([field], [gold]) == [0.0]


@pytest.mark.parametrize(
    "completion,gold",
    [
        (r"\boxed{17}", "18"),
        (r"\boxed{\frac{1}{3}}", "0.5"),
        (r"\boxed{1} then \boxed{2}", "1"),  # only the last box counts
        (r"\boxed{p + q}", "p - q"),
        ("I don't know.", "5"),
        ("", "5"),
        (r"\boxed{5}", ""),  # empty gold never matches
    ],
)
def test_accuracy_wrong(acc: MathAccuracy, completion: str, gold: str) -> None:
    assert acc([completion], [gold]) == [0.0]


# A GSM8K test reference solution (tail) whose `$...$` spans outranked "#### 6" in the whole-text parse.
GSM8K_DOLLAR_SPANS = (
    "First find the fee: 2 days * $2.00/day = $<<2*2=4.00>>4.00\n"
    'Then add the "more than a week overdue" fee to the answer from the previous step to find the '
    "total: $4.00 + $2.00 = $<<4+2=6.00>>6.00\n#### 6"
)


@pytest.mark.parametrize(
    "completion,gold",
    [
        (r"\boxed{\text{18 dollars}}", "18"),  # number inside \text{} with a unit word
        (r"\boxed{\text{3.5 hours}}", "3.5"),
        (r"\boxed{\text{5,000 people}}", "5000"),
        (r"\boxed{5\,000}", "5000"),  # LaTeX thousands separators
        (r"\boxed{1\,234.5}", "1234.5"),
        (r"\boxed{1\,234\,567}", "1234567"),
        (r"\boxed{5{,}000}", "5000"),
        (r"\boxed{5\!000}", "5000"),
        (r"\boxed{\text{5\,000 people}}", "5000"),
        (r"\boxed{1\ 000}", "1000"),  # control space and tie as separators
        (r"\boxed{1~000}", "1000"),
        (r"\boxed{1 000}", "1000"),  # a plain (or no-break, thin) space in the box: math-verify reads 1*0
        (r"\boxed{12 345}", "12345"),
        ("\\boxed{1\u202f000\u00a0000}", "1000000"),
        (r"\boxed{1000}", "1 000"),  # ... and in a gold
        (r"I have 3 100-page books, so \boxed{300}", "300"),  # free text keeps its spaces
        (r"\boxed{5}", "5 dollars"),  # a gold with unit words is its number, as a box is
        (r"\boxed{5 \text{ cm}}", r"\text{5 cm}"),
        (r"The answer is $5\,000$.", "5000"),  # unboxed, and after "####", alike
        (r"#### 5\,000", "5000"),
        (r"\boxed{5000}", r"5\,000"),  # a gold written with a separator
        (r"\boxed{5000}", r"5\;000"),
        (r"\boxed{18 dollars}", "18"),  # bare unit words after the number
        (r"\boxed{5 USD}", "5"),
        (r"\boxed{1,250 dollars}", "1250"),
        (r"\boxed{15 cm^2}", "15"),  # unit symbols: a whitelisted abbreviation, a power, a rate
        (r"\boxed{15\,cm^{2}}", "15"),
        (r"\boxed{864 inches^2}", "864"),
        (r"\boxed{20 km/h}", "20"),
        (r"\boxed{9.8 m/s^2}", "9.8"),
        (r"\boxed{60 miles/hour}", "60"),
        (r"\boxed{15 cm^2}", r"15\mbox{ cm}^2"),  # MATH-500 golds with a unit and its power
        (r"\boxed{864}", r"864 \mbox{ inches}^2"),
        (GSM8K_DOLLAR_SPANS, "6"),  # no box: the "####" line comes first
    ],
)
def test_accuracy_text_units_separators_hash_line(acc: MathAccuracy, completion: str, gold: str) -> None:
    assert acc([completion], [gold]) == [1.0]


@pytest.mark.parametrize(
    "completion,gold",
    [
        (r"\boxed{\text{19 dollars}}", "18"),
        (r"\boxed{\text{2 and 3}}", "3"),  # not one number: no unwrapped candidate
        (r"\boxed{5\,001}", "5000"),
        (r"\boxed{5\,000}", "0"),  # math-verify alone reads 5\,000 as 5*0
        (r"\boxed{5\,001}", "6"),  # ... and 5\,001 as 6
        (r"The answer is $5\,000$.", "0"),  # the same without a box
        (r"The answer is $5\,001$.", "6"),
        (r"\boxed{0}", r"5\,000"),  # a gold with a separator is 5000, not 5*0
        (r"\boxed{19 dollars}", "18"),
        (r"\boxed{3 x}", "3"),  # one-letter (and 2-letter) words are algebra, not units
        (r"\boxed{3 x^2}", "3"),  # ... also with a power or as a ratio (units: a whitelist)
        (r"\boxed{20 m^2}", "20"),
        (r"\boxed{3 ab/c}", "3"),
        (r"\boxed{3 x/y}", "3"),
        (r"\boxed{16 cm^2}", r"15\mbox{ cm}^2"),
        (r"\boxed{3 million km}", "3"),
        (r"\boxed{2 pi}", "2"),
        (r"\boxed{2 sin x}", "2"),  # maths and magnitude words are not units
        (r"\boxed{4 factorial}", "4"),
        (r"\boxed{3 million}", "3"),
        (r"\boxed{5 less than x}", "5"),
        (r"\boxed{3 squared}", "3"),
        (r"\boxed{\text{3 million}}", "3"),  # inside \text{} the same words are not units either
        (r"\boxed{\text{5 less than x}}", "5"),
        (r"\boxed{\text{5 or six}}", "5"),
        (r"\boxed{1 000}", "0"),  # 1 000 is 1000, not 1*0
        (r"\boxed{6}", "5 dollars"),
        (r"\boxed{3}", "3 million"),  # a gold's magnitude words stay
        (r"\boxed{5 001}", "6"),
        (GSM8K_DOLLAR_SPANS.replace("#### 6", "#### 7"), "6"),
        (GSM8K_DOLLAR_SPANS.replace("#### 6", "#### 7"), "4"),  # earlier `$4.00` span no longer wins
    ],
)
def test_accuracy_units_separators_hash_line_wrong(acc: MathAccuracy, completion: str, gold: str) -> None:
    assert acc([completion], [gold]) == [0.0]


# A markdown solution with `####` headings and no box (a base model's habit).
MARKDOWN_HEADINGS = "#### Step 1: Eggs left\n16 - 7 = 9\n#### Step 2: Money\nShe earns 9 * 2 = 18 dollars.\n\nThe answer is 18."


@pytest.mark.parametrize(
    "completion,gold,expected",
    [
        (MARKDOWN_HEADINGS, "18", 1.0),  # a heading after `####` is not the answer line
        (MARKDOWN_HEADINGS, "2", 0.0),
        ("work\n#### -5", "-5", 1.0),
        ("work\n#### \\frac{1}{2}", "0.5", 1.0),
        # one value per box: all boxes together answer a multi-valued gold
        (r"The solutions are $x=\boxed{1}$ and $x=\boxed{-2}$.", "1,-2", 1.0),
        (r"$\boxed{3}$, $\boxed{5}$ and $\boxed{7}$", "3, 5, 7", 1.0),
        (r"$x = \boxed{1+\sqrt{19}}$ or $x = \boxed{1-\sqrt{19}}$", r"1 \pm \sqrt{19}", 1.0),
        (r"\boxed{1} or \boxed{-2} or \boxed{3}", "1,-2", 0.0),  # a hedged extra value still fails
        (r"\boxed{5}, no: \boxed{4}", "5", 0.0),  # a single-valued gold: only the last box
        (r"\boxed{1} and \boxed{2}", "(1,2)", 0.0),  # a tuple is one value
        (r"\boxed{58} and \boxed{500}", r"58,\!500", 0.0),  # a thousands comma does not make two values
        # an unfinished box is not its number (math-verify's `$5+$` is 5)
        (r"\boxed{5+}", "5", 0.0),
        (r"\boxed{5 \le}", "5", 0.0),
        (r"\boxed{5 \times}", "5", 0.0),
        # a relation with no left side is not its number ("not 72", "at least 72"), math-verify reads 72
        (r"\boxed{\neq 72}", "72", 0.0),
        (r"\boxed{\ge 72}", "72", 0.0),
        (r"\boxed{> 72}", "72", 0.0),
        (r"\boxed{\neg 72}", "72", 0.0),
        ("<answer>\u2260 72</answer>", "72", 0.0),
        (r"\boxed{\approx 72}", "72", 1.0),  # ... approximately 72 is still 72,
        (r"\boxed{\left(72\right)}", "72", 1.0),  # \left is no \le,
        (r"\boxed{x \geq 2}", r"x \ge 2", 1.0),  # and an inequality with its left side is one
        (r"\boxed{\nleq 72}", "72", 0.0),  # negated relations too,
        (r"\boxed{\notin 72}", "72", 0.0),
        ("\\boxed{\u226e 72}", "72", 0.0),
        (r"\boxed{{\ge} 72}", "72", 0.0),
        (r"\boxed{\ge 5}", r"\ge 5", 1.0),  # unless the gold itself starts with one
        (r"\boxed{\neg p \lor q}", r"\neg p \lor q", 1.0),
        (r"\boxed{<<2*9=18>>18}", "18", 1.0),  # GSM8K's calculator markup is no relation,
        (r"\boxed{<1, 2, 3>}", "<1, 2, 3>", 1.0),  # nor a vector in angle brackets
        (r"\boxed{5\%}", "5", 1.0),  # ... while a percent sign or \text{} box still is
        (r"\boxed{5 \text{ cm}}", "5", 1.0),
        (r"\boxed{18 \hbox{ m}}", "18", 1.0),
        (r"\boxed{5 \operatorname{cm}}", "5", 1.0),
        (r"\boxed{18.}", "18", 1.0),  # sentence punctuation inside the box
        (r"\boxed{-0.5,}", "-0.5", 1.0),
        (r"\boxed{5+.}", "5", 0.0),
        # `\pm` glued to its operand, and a list whose second value has three digits
        (r"\boxed{1} and \boxed{-1}", r"\pm1", 1.0),
        (r"\boxed{3+2\sqrt{2}}, \boxed{3-2\sqrt{2}}", r"3\pm2\sqrt{2}", 1.0),
        (r"\boxed{2} and \boxed{100}", "2, 100", 1.0),
        # the `####` line read through markdown and prefixes; numbered headings are not answers
        ("She sells 9 eggs at $2 each.\n#### **18**\n(9 eggs x 2 dollars)", "18", 1.0),
        ("#### Answer: 18\nsince 3 * 6", "18", 1.0),
        ("#### x = 18\nin 2 steps", "18", 1.0),
        ("#### 1. Setup\n#### 2. Result\nShe earns 18 dollars.", "18", 1.0),
        ("#### 3) Result\nShe earns 18 dollars.", "18", 1.0),
        ("#### **Answer:** 18\n(9 eggs x 2 dollars)", "18", 1.0),
        ("#### -$5", "-5", 1.0),
        ("#### n = 3 apples per box\nTotal: 3*6 = 18 apples", "18", 1.0),  # a definition, not the answer
        ("#### s = 5 m/s, t = 4 s\nd = 20 m", "20", 1.0),
        (r"\boxed{18, ...}", "18", 0.0),  # a sequence, not 18
        (r"\boxed{0.33...}", "0.33", 0.0),  # 1/3, not 0.33
        (r"\boxed{\hbox{18 dollars}}", "18", 1.0),
    ],
)
def test_accuracy_headings_multi_boxes_unfinished_boxes(acc: MathAccuracy, completion: str, gold: str,
                                                         expected: float) -> None:
    assert acc([completion], [gold]) == [expected]


# The `####` line is read as a box's content. math-verify alone took its last number, so each line below
# scored 1 against gold 18 although its boxed twin scores 0 (a reward hack in GSM8K training).
@pytest.mark.parametrize("line", [
    "16, 17, 18",  # several candidates
    "17 or 18",
    "18 is not right",  # words beyond the value
    "17 (not 18)",
    "18 dollars is wrong",  # (a negation is no unit word)
    r"\neq 18",  # a relation with no left side
    "> 18",
    r"$\geq 18$",
])
def test_hash_line_hedges_and_relations_score_zero(acc: MathAccuracy, line: str) -> None:
    assert acc([f"9 * 2 = 18\n#### {line}"], ["18"]) == [0.0]
    assert acc([f"\\boxed{{{line}}}"], ["18"]) == [0.0]  # as the box always did


@pytest.mark.parametrize("completion, gold", [
    ("#### - 5", "-5"),  # a sign apart from its number (read as 5 before)
    ("#### +3", "3"),  # (read as nothing before)
    ("#### 3, 4", "3, 4"),  # several values answer a gold that has several
    (r"#### 3 \pm 2", r"3 \pm 2"),
    (r"#### \ge 5", r"\ge 5"),  # a relation answers a gold that starts with one
    # what worked before still does
    ("#### 18", "18"),
    ("#### $18", "18"),
    ("#### 1,000", "1000"),
    ("#### 18 dollars", "18"),
    ("#### 18 dollars.", "18"),
    ("#### 20 km", "20"),  # a short unit word
    (r"#### 18 \text{ dollars}", "18"),
    (r"#### \frac{1}{2}", "0.5"),
    ("#### x = 18", "18"),
    ("#### **18**", "18"),
    ("#### Answer: 18", "18"),
    ("#### 17\nNo wait, she sells 9 eggs.\n#### 18", "18"),  # the last `####` line wins
    ("#### -5", "-5"),
    ("#### $-5", "-5"),
    ("#### -$5", "-5"),
    ("#### 18.", "18"),  # a final period
    ("#### 1 000", "1000"),  # a space as thousands separator, as in a box
])
def test_hash_line_read_as_a_box(acc: MathAccuracy, completion: str, gold: str) -> None:
    assert acc([completion], [gold]) == [1.0]


def test_hash_line_scored_answer() -> None:
    """What reports show next to the verdict: the line as scored, None for a refused one."""
    scorer = MathAccuracy()
    assert scorer.scored_answer("#### -$5") == "-5"
    assert scorer.scored_answer("#### 18 dollars") == "18"
    assert scorer.scored_answer("#### 17 or 18") is None
    assert scorer.scored_answer("#### 18\n#### 17") == "17"


# What a reviewer compared between 631ba22 (math-verify's plain parse of the `####` line: its last number) and the
# line read only as a box's content: the box reading fixed hedges and signs but refused every line with words the
# box list did not know. The line is now refused only for a hedge, a leading relation or several values, and is
# otherwise read both ways (`parse_hash_line`), so both columns below hold.
NATALIA = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72 clips in all.\n#### "


@pytest.mark.parametrize("line, gold", [
    ("71 or 72", "72"), ("72 or 73", "72"), ("72 or so", "72"),  # hedges
    ("72, 73", "72"), ("16, 17, 18", "18"), ("72; 73", "72"),  # several values for one
    (r"\neq 72", "72"), ("> 72", "72"), (r"\geq 72", "72"),  # "not 72", "at least 72"
    ("72 is not correct", "72"), ("18 is not right", "18"), ("17 (not 18)", "18"), ("18 dollars is wrong", "18"),
    ("72 isn't right", "72"),
    ("- 72", "72"),  # a sign apart from its number is still its sign (631ba22 read 72)
    ("72 and a half", "72"),  # 72.5
    ("18, ...", "18"), ("0.33...", "0.33"),  # a sequence; 1/3 (as in a box)
    ("2^{10}", "2"), (r"2\sqrt{3}", "2"), ("10^{100}", "10"),  # maths alone is not its first number
    ("5:30", "5"),  # (5:30 is read as a ratio, not as its hour)
])
def test_hash_line_fixes_score_zero(acc: MathAccuracy, line: str, gold: str) -> None:
    assert acc([NATALIA + line], [gold]) == [0.0]


@pytest.mark.parametrize("line, gold", [
    # signs, fractions, lists and times the box reading parses where math-verify's plain text does not
    ("- 5", "-5"), ("- $5", "-5"), ("-.5", "-0.5"), ("- .5", "-0.5"), (r"- \frac{1}{2}", "-0.5"), ("x = - 5", "-5"),
    (r"\dfrac12", "0.5"), (r"\frac34", "0.75"), ("+3", "3"),
    ("3, 4", "3, 4"), ("4, 3", "3, 4"), ("3,4", "3, 4"), ("3 and 4", "3, 4"),  # a list answers a gold with several
    ("5:30", "5:30"), ("- 72 clips", "-72"),
])
def test_hash_line_fixes_score_one(acc: MathAccuracy, line: str, gold: str) -> None:
    assert acc([NATALIA + line], [gold]) == [1.0]


@pytest.mark.parametrize("line, gold", [
    # trailing punctuation, emoticons and emphasis are no part of the value
    ("18,", "18"), ("18, ", "18"), ("$18,", "18"), ("1,234,", "1234"), ("18 dollars,", "18"), ("18 ...", "18"),
    ("72 clips!", "72"), ("72 clips?", "72"), ("72?", "72"), ("72!", "72"), ("72 :)", "72"),
    ("**18** dollars", "18"), ("18 **dollars**", "18"),
    # words after the value that are no hedge (`_NOT_UNITS` holds sec, more, less, times: units or comparisons)
    ("5 times", "5"), ("3 more", "3"), ("3 more apples", "3"), ("20 fewer", "20"), ("5 less", "5"), ("18 sec", "18"),
    ("72 percent", "72"), ("25 percent", "25"), ("2 dozen", "2"), ("18 more than last year", "18"),
    ("72 (clips)", "72"), ("18 (dollars)", "18"), ("18 [dollars]", "18"), ("72 (rounded)", "72"),
    ("72 (approximately)", "72"), ("18 (eighteen)", "18"), ("72 clips, which is the answer", "72"),
    ("3 days = 72 hours", "72"), ("72 (no remainder)", "72"),
    # units, with symbols math-verify's LaTeX leaves as a string or reads as algebra
    ("72 km/h", "72"), ("12 m/s", "12"), ("72 m^2", "72"), ("72 cm²", "72"), ("72 ft²", "72"), ("72 sq ft", "72"),
    ("72 €", "72"), ("-5°", "-5"), ("-5 °C", "-5"), ("12 x", "12"), ("12 y", "12"),
    ("1/2 cup", "0.5"), (r"\frac{1}{2} cup", "0.5"), ("3/4 of the pizza", "0.75"),
    ("12.5%", "12.5"), (r"12.5\%", "12.5"), ("12.5 %", "12.5"), ("12.5%", "0.125"),  # a percent is its number too
    ("12,5", "12.5"),  # a decimal comma, as math-verify reads it
])
def test_hash_line_regressions_undone(acc: MathAccuracy, line: str, gold: str) -> None:
    """Each scored 1 at 631ba22 and 0 with the line read only as a box."""
    assert acc([NATALIA + line], [gold]) == [1.0]


@pytest.mark.parametrize("gold, completion", [
    ("-$5", "#### -5"), ("- $5", "#### -5"), ("\u2212$5", "#### -5"), ("+$5", "#### 5"), ("-$5.50", "#### -5.50"),
    ("-$1,000", "#### -1000"), ("-$\\frac12$", r"\boxed{-\frac12}"), ("-$5", r"\boxed{-5}"),
])
def test_signed_dollar_golds_are_matchable(gold: str, completion: str) -> None:
    """A GSM8K gold `-$5` kept its `$` (math-verify reads that as nothing): no answer could match it."""
    assert MathAccuracy()([f"She owes it.\n{completion}"], [extract_gsm8k_gold(f"work\n#### {gold}")]) == [1.0]


@pytest.mark.parametrize("completion, gold, expected", [
    (r"\boxed{12.5\%}", "12.5", 1.0),  # math-verify matches `9\%` with 9 (integers) but `12.5\%` only with 0.125
    (r"\boxed{12.5%}", "12.5", 1.0),
    (r"\boxed{12.5\%}", "0.125", 1.0),
    (r"\boxed{12.5\%}", "13", 0.0),
    (r"\boxed{12.5\%}", "1.25", 0.0),
])
def test_boxed_decimal_percent_is_its_number(acc: MathAccuracy, completion: str, gold: str, expected: float) -> None:
    assert acc([completion], [gold]) == [expected]


# Against an integer gold a percentage is its number: math-verify matched `2500\%` with 25 (2500/100).
@pytest.mark.parametrize("completion, gold, expected", [
    (r"The price rose by $\boxed{25\%}$.", "25", 1.0),
    (r"The price rose by $\boxed{2500\%}$.", "25", 0.0),
    (r"The price rose by $\boxed{2500\%}$.", "2500", 1.0),
    (r"\boxed{-5\%}", "-5", 1.0),
    (r"\boxed{25\%}", "0.25", 1.0),  # a gold that is no integer keeps the fraction
    (r"\boxed{25\%}", r"\frac{1}{4}", 1.0),
    ("The price rose by 2500%.", "25", 0.0),  # without a box,
    (NATALIA + "2500%", "25", 0.0),  # and after `####`, alike
    (NATALIA + "25%", "25", 1.0),
])
def test_percent_against_an_integer_gold_is_its_number(acc: MathAccuracy, completion: str, gold: str,
                                                       expected: float) -> None:
    assert acc([completion], [gold]) == [expected]


# MATH-500 writes 25 of its golds in degrees, `30^\circ`; models also write `30°`, `30^{\circ}`, `30\degree`.
@pytest.mark.parametrize("completion, gold, expected", [
    (r"Since the triangle is equilateral, $\angle ABC = \boxed{60°}$.", r"60^\circ", 1.0),  # (a string to math-verify)
    (r"Hence the angle measures $\boxed{30^{\circ}}$.", r"30^\circ", 1.0),
    (r"Hence the angle measures $\boxed{30\degree}$.", r"30^\circ", 1.0),
    (r"\boxed{30 °}", r"30^\circ", 1.0),
    (r"\boxed{31°}", r"30^\circ", 0.0),
    (r"The point is $\boxed{(3, 90°)}$.", r"(3, 90^\circ)", 1.0),  # math-verify read `(3, 90°)` as 90
    (r"The point is $\boxed{(3, 90°)}$.", "90", 0.0),
    (r"$\boxed{45°}$ and $\boxed{135°}$", r"45^\circ, 135^\circ", 1.0),  # boxed one value at a time
    (r"\boxed{30}", "30°", 1.0),  # a gold's degree sign is read the same way
])
def test_degree_signs(acc: MathAccuracy, completion: str, gold: str, expected: float) -> None:
    assert acc([completion], [gold]) == [expected]


# MATH-500's intervals with an infinite end (4 problems): math-verify ignored the bracket there (sympy's Interval is
# open at ±∞), so `[-\infty, 0]` matched `(-\infty, 0]`.
@pytest.mark.parametrize("completion, gold, expected", [
    (r"The solution set is $\boxed{(-\infty,0]}$.", r"(-\infty, 0]", 1.0),
    (r"The solution set is $\boxed{(-\infty,0)}$.", r"(-\infty, 0]", 0.0),
    (r"The solution set is $\boxed{[-\infty,0]}$.", r"(-\infty, 0]", 0.0),
    (r"The domain is $\boxed{(2,\infty]}$.", r"(2,\infty)", 0.0),
    (r"The domain is $\boxed{\left(2, \infty \right]}$.", r"(2,\infty)", 0.0),
    (r"The domain is $\boxed{(2, +\infty)}$.", r"(2,\infty)", 1.0),
    (r"\boxed{(-\infty, 2) \cup (3, \infty]}", r"(-\infty, 2) \cup (3, \infty)", 0.0),
    (r"\boxed{(-\infty, 2) \cup (3, \infty)}", r"(-\infty, 2) \cup (3, \infty)", 1.0),
])
def test_a_bracket_at_infinity_counts(acc: MathAccuracy, completion: str, gold: str, expected: float) -> None:
    assert acc([completion], [gold]) == [expected]


# A quantity in mixed units is none of its numbers: math-verify read each box below as its first number.
@pytest.mark.parametrize("completion, gold, expected", [
    (r"The trip takes $\boxed{2\text{ hours and }30\text{ minutes}}$.", "2", 0.0),
    (r"He is $\boxed{5 \text{ feet } 6 \text{ inches}}$ tall.", "5", 0.0),
    (r"\boxed{1 \text{ hour}, 30 \text{ minutes}}", "1", 0.0),
    (r"\boxed{18 \text{ dollars per hour for } 5 \text{ hours}}", "18", 0.0),
    (r"\boxed{3 \text{ and } 4}", "3, 4", 1.0),  # two values, read as a list, answer a gold with two
    (r"\boxed{15\text{ cm}^2}", "15", 1.0),  # one number and its unit still is that number
    (r"\boxed{2\text{nd}}", "2", 1.0),
])
def test_compound_quantities_are_not_their_first_number(acc: MathAccuracy, completion: str, gold: str,
                                                        expected: float) -> None:
    assert acc([completion], [gold]) == [expected]


@pytest.mark.parametrize("completion, answer", [
    (NATALIA + "72 clips!", "72"),  # the number read as text
    (NATALIA + "3 days = 72 hours", "72"),
    (NATALIA + "72 :)", "72"),
    (NATALIA + "- $5", "-5"),  # the line read as a box
    (NATALIA + r"\dfrac12", r"\dfrac12"),
    (NATALIA + "72 and a half", "72 and a half"),  # a list is shown whole (its plain reading, 72, is not it)
    (NATALIA + "12,5", "12,5"),
    (NATALIA + "72 is not correct", None),  # a hedge: nothing scored
])
def test_hash_line_scored_answer_is_what_was_compared(completion: str, answer: str | None) -> None:
    assert MathAccuracy().scored_answer(completion) == answer


@pytest.mark.parametrize("text, expected", [
    ("72?", "72"), ("72 clips!", "72 clips"), ("18,", "18"), ("1,234,", "1,234"), ("18 .", "18"), ("18 ...", "18"),
    ("72 :)", "72"), ("72 !!! :) .", "72"), ("18 \u2026", "18"), ("5:30", "5:30"),
    ("0.33...", "0.33..."), ("18, ...", "18, ..."),  # an ellipsis after a digit or a comma is maths
    ("72:)", "72:)"), (":)", ":)"), ("", ""),  # an emoticon needs a blank before it
])
def test_strip_trailing_marks(text: str, expected: str) -> None:
    from qerl.answers import strip_trailing_marks

    assert strip_trailing_marks(text) == expected


@pytest.mark.parametrize("line, expected", [
    ("**18** dollars", "18 dollars"), ("18 **dollars**", "18 dollars"), ("**$18**", "18"),
    ("2**10", "2**10"),  # a power in plain text is no emphasis
    ("- $5", "-5"), ("-$5", "-5"), ("+3", "3"), ("- .5", "-.5"), ("$18,", "18"), ("72 :)", "72"),
])
def test_clean_hash_answer(line: str, expected: str) -> None:
    from qerl.answers import clean_hash_answer

    assert clean_hash_answer(line) == expected


@pytest.mark.parametrize("line, hedges", [
    ("71 or 72", True), ("72 is not correct", True), ("17 (not 18)", True), ("18 dollars is wrong", True),
    ("72 isn\u2019t it", True), ("maybe 72", True),
    ("18 sec", False), ("5 times", False), ("3 more", False), ("72 (rounded)", False),  # not `_NOT_UNITS`
    (r"\notin A", False), (r"18 \text{ or } 19", True), ("72 hours", False), ("72 (no remainder)", False),
])
def test_hash_line_hedges(line: str, hedges: bool) -> None:
    from qerl.answers import hash_line_hedges

    assert hash_line_hedges(line) is hedges


@pytest.mark.parametrize("line, several", [
    ("16, 17, 18", True), ("72; 73", True), ("3 and 4", True), ("72 and a half", True), (r"3 \pm 2", True),
    ("18, ...", True), ("72 apples and 3 oranges", True),
    ("1,234", False), ("1,234,567.5", False), ("(1, 2)", False), (r"\{3, 4\}", False), ("12,5", False),
    ("72 clips, which is the answer", False), ("72 (48 in April and 24 in May)", False), ("3 days = 72 hours", False),
    ("18", False), ("", False),
])
def test_lists_several_values(line: str, several: bool) -> None:
    from qerl.math_parsing import lists_several_values

    assert lists_several_values(line) is several


@pytest.mark.parametrize("field", ["She owes $5.\n#### -$5", "#### \u2212$5", "#### - \\$ 5", "#### $-5"])
def test_gsm8k_gold_with_sign_and_dollar(field: str) -> None:
    """`-$5` kept its `$` (stripped only at the ends): math-verify reads that gold as nothing, so no answer
    matched it. The sign goes with the number (U+2212 as `-`)."""
    gold = extract_gsm8k_gold(field)
    assert gold == "-5"
    assert MathAccuracy()([r"\boxed{-5}", "#### -5", r"\boxed{5}"], [gold] * 3) == [1.0, 1.0, 0.0]
    assert extract_gsm8k_gold("#### -$1,000") == "-1000"  # and a signed amount loses its separators
    assert extract_answer("work\n#### -$5") == "-5"  # the logged answer, cleaned the same way


def test_the_last_box_counts_wherever_it_is(acc: MathAccuracy) -> None:
    """The box is found in the whole completion (only what math-verify parses is capped at max_chars):
    a right box then 10,500 characters of rambling is right; a wrong box is not rescued by a later bare
    number. FormatReward and extract_answer read the same box."""
    ramble = " and so on" * 1_050
    right_then_ramble = r"So the answer is $\boxed{18}$." + ramble
    wrong_then_number = r"So $\boxed{17}$." + ramble + " Actually it is 18"
    assert acc([right_then_ramble, wrong_then_number], ["18", "18"]) == [1.0, 0.0]
    assert FormatReward()([right_then_ramble, wrong_then_number], ["18"] * 2) == [1.0, 1.0]
    assert [extract_answer(right_then_ramble), extract_answer(wrong_then_number)] == ["18", "17"]
    assert acc(["x " * 6_000 + "#### 18"], ["18"]) == [1.0]  # without a box: the tail
    assert MathAccuracy(max_chars=20)([r"\boxed{" + "1+" * 20 + "0}"], ["20"]) == [0.0]  # an over-long box


@pytest.mark.parametrize(
    "completion,gold,expected",
    [
        ("work\n#### \u22125", "-5", 1.0),  # U+2212 MINUS SIGN, read as LaTeX's `\boxed{−5}` already is
        ("The answer is \u22125.", "-5", 1.0),
        ("#### \uff0d5", "-5", 1.0),  # fullwidth hyphen-minus
        ("#### \u20135", "-5", 1.0),  # an en dash as a sign ...
        ("pages 12\u20135", "-5", 0.0),  # ... but not between numbers (a range)
        ("work\n#### \u22125", "5", 0.0),
    ],
)
def test_unicode_minus_without_a_box(acc: MathAccuracy, completion: str, gold: str, expected: float) -> None:
    assert acc([completion], [gold]) == [expected]


@pytest.mark.parametrize("text,expected", [("#### \u22125", "-5"), ("so x = \u22123.5", "-3.5"),
                                           ("The answer is \uff0d2", "-2"), ("pages 3\u20135", "5")])
def test_extract_answer_reads_unicode_minus(text: str, expected: str) -> None:
    assert extract_answer(text) == expected


def test_accuracy_batch_and_components(acc: MathAccuracy) -> None:
    out = acc([r"\boxed{3}", r"\boxed{4}", r"\boxed{3}"], ["3", "3", "3"])
    assert out == [1.0, 0.0, 1.0]
    assert acc.last_components == {"accuracy": [1.0, 0.0, 1.0]}
    assert acc([], []) == []


def test_length_mismatch_raises(acc: MathAccuracy) -> None:
    with pytest.raises(ValueError):
        acc(["a"], [])


def test_accuracy_in_worker_thread() -> None:
    """Signals are main-thread only; in a thread the reward must still work (unbounded)."""
    result: list[list[float]] = []
    worker = threading.Thread(target=lambda: result.append(MathAccuracy()([r"\boxed{0.5}", "x"], ["1/2", "1"])))
    worker.start()
    worker.join(30)
    assert result == [[1.0, 0.0]]


# ---------------------------------------------------------------- robustness

ADVERSARIAL = [
    "{" * 100_000,
    "\\boxed{" + "{" * 5_000 + "1" + "}" * 5_000 + "}",
    "\\boxed{" * 20_000,
    r"The answer is \boxed{",
    r"\boxed{9^{9^{9^{9}}}}",
    r"\boxed{99999999!}",
    "\\boxed{" + "\\frac{" * 300 + "}",
    "\u202e\ud800\x00\uffff 🤖 \\boxed{\u0000\u200b}",
    "$" * 50_000,
    "\\" * 30_000,
    "",
    "   ",
]


def test_adversarial_bounded_and_never_raises() -> None:
    reward = WeightedSum([MathAccuracy(timeout_s=0.5), FormatReward()])
    start = time.monotonic()
    out = reward(ADVERSARIAL, ["5"] * len(ADVERSARIAL))
    elapsed = time.monotonic() - start
    assert len(out) == len(ADVERSARIAL) and all(isinstance(v, float) for v in out)
    assert reward.last_components["accuracy"] == [0.0] * len(ADVERSARIAL)
    # Per completion at most ~timeout_s; the cheap ones take milliseconds.
    assert elapsed < 8.0, f"adversarial batch took {elapsed:.1f}s"


@pytest.mark.parametrize("timeout_s", [0.0, float("inf"), 1e12])
def test_no_timeout_means_no_limit(timeout_s) -> None:
    """0 and .inf both mean "no limit" (setitimer overflows on inf, which scored every completion 0)."""
    assert MathAccuracy(timeout_s=timeout_s)([r"so \boxed{4}"], ["4"]) == [1.0]


def test_nan_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        MathAccuracy(timeout_s=float("nan"))


def test_deadline_inside_a_finalizer_is_not_reported_as_unraisable(monkeypatch) -> None:
    """The alarm can land in a ``__del__`` (or a generator the GC closes), where it cannot propagate:
    Python hands it to ``sys.unraisablehook`` (pytest's fails the test, CI once did) and the timer's
    re-fire ends the call. Other unraisable exceptions still reach the previous hook."""
    import sys

    from qerl.rewards import _deadline

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(type(u.exc_value).__name__))

    class SlowFinalizer:
        def __del__(self):
            t0 = time.monotonic()
            while time.monotonic() - t0 < 0.2:  # the 0.05 s deadline fires in here
                pass

    class BrokenFinalizer:
        def __del__(self):
            raise KeyError("not ours")

    def work():
        SlowFinalizer()  # finalized at once (refcount 0)
        BrokenFinalizer()
        while True:  # the re-fire stops this loop
            pass

    with pytest.raises(TimeoutError):
        _deadline(work, 0.05)
    assert seen == ["KeyError"] and sys.unraisablehook is not None
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0.0


def test_non_string_inputs_score_zero() -> None:
    bad: list = [None, 5, b"\\boxed{5}", ["\\boxed{5}"]]
    assert MathAccuracy()(bad, ["5"] * 4) == [0.0] * 4
    assert FormatReward()(bad, ["5"] * 4) == [0.0] * 4
    assert MathAccuracy()([r"\boxed{5}"], [None]) == [0.0]  # type: ignore[list-item]
    assert extract_boxed(None) is None  # type: ignore[arg-type]
    assert extract_answer(None) is None  # type: ignore[arg-type]


def test_huge_exponent_and_earlier_timer_untouched(caplog) -> None:
    """A timeout yields 0.0, and the SIGALRM handler is restored afterwards. (`99999999!`: sympy's factorial
    runs in Python and stops at the deadline; `9^{9^{9^{9}}}`, used here before, no longer reaches math-verify.)"""
    import signal

    before = signal.getsignal(signal.SIGALRM)
    start = time.monotonic()
    reward_function._warn_state["last"] = 0.0
    with caplog.at_level(logging.WARNING):
        assert MathAccuracy(timeout_s=0.3)([r"\boxed{99999999!}"], ["5"]) == [0.0]
    assert "TimeoutError" in caplog.text  # the deadline, not anything else, gave the 0
    assert time.monotonic() - start < 3.0
    assert signal.getsignal(signal.SIGALRM) is before
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0.0


# Power towers: math-verify's numeric check of `10^{10^{10^{10}}}` against `y^2` shifts a big integer by ~10^10 bits
# in one C call (10-19 s and ~9 GB past a 2 s deadline): such answers and golds are compared as text instead.
@pytest.mark.parametrize("completion, gold, expected", [
    (r"\boxed{10^{10^{10^{10}}}}", "y^2", 0.0),  # measured: 10-19 s, ~9 GB
    (r"\boxed{2^{2^{2^{35}}}}", "y^2", 0.0),  # 7.7 s, 9 GB
    (r"\boxed{2^{2^{2^{37}}}}", "(x+1)^2", 0.0),  # asked for 16+ GB
    (r"\boxed{10^{10^{10^{10}}}+1}", r"\frac{\sqrt3}{2}", 0.0),  # inside a sum
    (r"\boxed{e^{10^{10^{10}}}}", "y^2", 0.0),  # e^{...} and \exp: powers of e
    (r"\boxed{\exp(10^{10^{10}})}", "y^2", 0.0),
    ("The answer is 2**2**2**35", "y^2", 0.0),  # math-verify reads `**` in plain text
    ("The answer is 10^10^10^10", "y^2", 0.0),
    ("#### 10^{10^{10^{10}}}", "y^2", 0.0),
    ("<answer>10^{10^{10^{10}}}</answer>", "y^2", 0.0),
    (r"\boxed{y^2}", "10^{10^{10^{10}}}", 0.0),  # a gold that is a tower is guarded too
    (r"\boxed{10^{10^{10^{10}}}}", "10^{10^{10^{10}}}", 1.0),  # ... and matched as text,
    (r"\boxed{10^{ 10^{10^{10}} }}", "$10^{10^{10^{10}}}$", 1.0),  # up to spaces and `$`,
    (r"\boxed{10^{10^{10^{11}}}}", "10^{10^{10^{10}}}", 0.0),  # not as numbers
    ("So the answer is $10^{10^{10^{10}}}$.", "10^{10^{10^{10}}}", 1.0),  # the tail: what its lazy parse took
    ("The answer is 5.", "10^{10^{10^{10}}}", 0.0),  # a tower gold against a tail
])
def test_power_towers_never_reach_math_verify(monkeypatch, completion: str, gold: str, expected: float) -> None:
    """Bounded by construction: math-verify is not called at all (a deadline cannot stop its C-level shift)."""
    calls = []
    monkeypatch.setattr(rewards_module.math_verify, "verify", lambda *a, **k: calls.append(a) or False)
    assert MathAccuracy().score_one(completion, gold) == expected  # (score_one: no warm-up verify call)
    assert calls == []


@pytest.mark.parametrize("completion, gold", [
    (r"\boxed{2^{10}}", "1024"),
    (r"\boxed{2^{2^{10}}}", "2^{1024}"),  # 309 digits, a real answer's size
    (r"\boxed{10^{100}}", "10^{100}"),
    (r"\boxed{2^{2007}}", "2^{2007}"),  # 605 digits (MATH has such answers)
    (r"\boxed{e^{x^2}}", "e^{x^2}"),  # a symbol's power has no size to bound
    (r"\boxed{\exp(x^2)}", "e^{x^2}"),  # equal under math-verify, not as text: math-verify compared them
    ("#### 2^{10}", "1024"),
    # past the former bound (10^10000, compared as text) and below 10^(10^6): equal forms of one number
    (r"\boxed{2^{40000}}", "4^{20000}"),
    (r"\boxed{1.0001^{10000}}", "(1.0001)^{10000}"),
    (r"\boxed{\frac{2^{40000}}{2}}", "2^{39999}"),
    (r"\boxed{10^{1000000}}", "10^{1000000}"),
])
def test_real_powers_still_go_to_math_verify(completion: str, gold: str) -> None:
    assert MathAccuracy()([completion], [gold]) == [1.0]


@pytest.mark.parametrize("completion, gold", [
    ("Since 10^{10^{10}} is huge, the answer is 5.", "5"),
    ("(0.9999)^{10000} ~ e^{-1}. The answer is 3.", "3"),
    ("Thus 1.0001^{10000} is about e, and the answer is 3.", "3"),
    ("**10000**\n**50000** items means the answer is 5.", "5"),  # markdown bold, not `10000**50000`
    ("We compute **2**\n**50000** ... answer is 5.", "5"),
])
def test_a_tower_in_the_reasoning_does_not_guard_the_answer(monkeypatch, completion: str, gold: str) -> None:
    """Without a box or `####` line the guard ran on the whole tail, so a power mentioned before the answer forced a
    text comparison (0). It runs on what math-verify's lazy parse takes from the tail (the 5), which is verified."""
    calls = []
    real_verify = rewards_module.math_verify.verify
    monkeypatch.setattr(rewards_module.math_verify, "verify", lambda *a, **k: calls.append(a) or real_verify(*a, **k))
    assert MathAccuracy().score_one(completion, gold) == 1.0
    assert len(calls) == 1


@pytest.mark.parametrize("text, huge", [
    ("10^{1000000}", False), ("10^{1000001}", True),  # the bound: 10^(10^6)
    ("2^{2^{16}}", False), ("2^{2^{20}}", False), ("2^{2^{22}}", True),  # 19729 digits; 315653; 1262612
    ("2^2^2^2^2", False), ("2^2^2^2^2^2", True),  # right-associative: 2^65536, not (2^2)^... = 65536
    ("10^{10^{10^{10}}}", True), ("x^{10^{10^{10}}}", True),  # an exponent past the bound is itself one
    ("10^{-10^{10^{10}}}", True), (r"\frac{1}{10^{10^{10^{10}}}}", True),  # signs and fractions: magnitudes
    ("(10^{10})^{10^{10}}", True), ("{10^{10}}^{10^{10}}", True), ("9^{9^{9^{9}}}", True),
    (r"2^\left(10^{10^{5}}\right)", True), ("2^-10^{10^{5}}", True), (r"\mathrm{e}^{10^{7}}", True),
    (r"2^{\frac{10^{10^{10}}}{3}}", True), ("2^{(10^{10})!}", True),  # a factorial inside a power counts,
    ("99999999!", False), ("(10^{10})!", False),  # alone it is left to the deadline (sympy loops in Python)
    ("1e100000000000", False),  # a float's exponent is no big integer
    (r"e^{-\frac{x^2}{2\sigma^2}}", False), ("x^{1000000}", False), (r"(1+\frac{0.05}{12})^{120}", False),
    (r"180^\circ - (14^\circ + 90^\circ) = 76^\circ", False),  # `^\circ` is a symbol exponent, not the next number
    ("She earns 18 dollars (9 * 2 = 18)!", False), ("", False), ("^" * 1000, False), ("{" * 100_000, False),
])
def test_has_huge_power(text: str, huge: bool) -> None:
    from qerl.huge_power import has_huge_power

    assert has_huge_power(text) is huge


def test_has_huge_power_is_one_pass_without_recursion() -> None:
    """Deep nesting and long chains end (a stack, no recursion: 100k levels would overflow Python's) and never raise."""
    from qerl.huge_power import has_huge_power

    assert has_huge_power("x^{" * 100_000) is False
    assert has_huge_power("2^{" * 100_000) is True
    assert has_huge_power("1^1!" * 100_000) is False
    assert has_huge_power(")]}" * 10_000 + "2^{2^{10}}") is False  # stray closing brackets are separators


# ---------------------------------------------------------------- format and sums


@pytest.mark.parametrize(
    "completion,expected",
    [
        (r"reasoning... so $\boxed{5}$.", 1.0),
        (r"\boxed{1} or maybe \boxed{2}", 0.0),
        (r"\boxed{}", 0.0),
        (r"\boxed{  }", 0.0),
        (r"\boxed{", 0.0),
        ("no box", 0.0),
        (r"\boxed{\frac{1}{2}}", 1.0),
    ],
)
def test_format_reward(completion: str, expected: float) -> None:
    fmt = FormatReward()
    assert fmt([completion], ["x"]) == [expected]
    assert fmt.last_components == {"format": [expected]}


def test_format_reward_near_end() -> None:
    fmt = FormatReward(max_chars_after=10)
    assert fmt([r"\boxed{5}.", r"\boxed{5}" + " and more text" * 5], ["5", "5"]) == [1.0, 0.0]


def test_weighted_sum_components() -> None:
    reward = WeightedSum([MathAccuracy(), FormatReward()], weights=[1.0, 0.2])
    completions = [r"\boxed{18}", r"\boxed{17}", "18", r"\boxed{1} \boxed{18}"]
    out = reward(completions, ["18"] * 4)
    assert out == pytest.approx([1.2, 0.2, 1.0, 1.0])
    assert reward.last_components == {"accuracy": [1.0, 0.0, 1.0, 1.0], "format": [1.0, 1.0, 0.0, 0.0]}
    assert isinstance(reward, RewardFunction) and reward.name == "weighted_sum"


def test_weighted_sum_defaults_and_duplicates() -> None:
    reward = WeightedSum([FormatReward(), FormatReward(max_chars_after=0)])
    assert reward([r"\boxed{1}!"], ["1"]) == [1.0]
    assert reward.last_components == {"format": [1.0], "format_1": [0.0]}
    with pytest.raises(ValueError):
        WeightedSum([FormatReward()], weights=[1.0, 2.0])
    with pytest.raises(ValueError):
        WeightedSum([])


def test_jsonargparse_instantiates_from_class_path() -> None:
    """YAML configs select rewards by class_path; check the constructors are jsonargparse-friendly."""
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--reward", type=RewardFunction)
    cfg = parser.parse_object(
        {
            "reward": {
                "class_path": "qerl.rewards.WeightedSum",
                "init_args": {
                    "rewards": [
                        {"class_path": "qerl.rewards.MathAccuracy", "init_args": {"boxed_only": True}},
                        {"class_path": "qerl.rewards.FormatReward"},
                    ],
                    "weights": [1.0, 0.2],
                },
            }
        }
    )
    reward = parser.instantiate_classes(cfg).reward
    assert isinstance(reward, WeightedSum) and reward.rewards[0].boxed_only is True
    assert reward([r"\boxed{2}"], ["2"]) == pytest.approx([1.2])


def test_a_broken_math_verify_fails_loudly(monkeypatch) -> None:
    """math-verify that cannot match \\boxed{1} with '1' (a broken install) stops the run at the
    first batch instead of scoring every completion 0 with rate-limited warnings."""
    import qerl.rewards as R
    monkeypatch.setattr(R.math_verify, "verify", lambda *a, **k: False)
    with pytest.raises(RuntimeError, match="math-verify"):
        MathAccuracy()(["\\boxed{1}"], ["1"])


def test_non_finite_rewards_score_zero_with_a_warning(caplog) -> None:
    """A custom reward's NaN would reach its group's advantages and skip the whole update."""

    class Flaky(RewardFunction):
        name = "flaky"

        def compute(self, completions, answers):
            return [float("nan"), 1.0, float("inf")]

    total = WeightedSum([Flaky(), FormatReward()])
    with caplog.at_level(logging.WARNING, logger="qerl.rewards"):
        reward_function._warn_state["last"] = 0.0
        assert total(["a", r"\boxed{1}", "c"], ["1"] * 3) == [0.0, 2.0, 0.0]
    assert total.last_components == {"flaky": [0.0, 1.0, 0.0], "format": [0.0, 1.0, 0.0]}
    assert "Flaky returned 2 non-finite rewards of 3" in caplog.text

    class Short(RewardFunction):
        def compute(self, completions, answers):
            return [1.0]

    with pytest.raises(ValueError, match="Short.compute returned 1 rewards for 2 completions"):
        Short()(["a", "b"], ["1", "1"])


def test_many_boxes_cost_linear_time():
    """``boxed_answers`` kept the outermost boxes by comparing every pair: ~110,000 boxes (1 MB) took
    seconds, and outside the main thread, where no deadline can fire, minutes. The result is the same."""
    from qerl.answers import boxed_answers

    text = "\\boxed{1}" * 110_000 + "\\boxed{\\boxed{2} and 3}"
    assert boxed_answers(text) == ["1", "\\boxed{2} and 3"]
    assert boxed_answers("\\boxed{a} \\boxed{\\fbox{b}} \\boxed{a} \\boxed{c") == ["a", "\\fbox{b}"]


@pytest.mark.parametrize("completion, gold", [
    ("\\boxed{１２}", "12"),                       # fullwidth
    ("\\boxed{٧٢}", "72"),                         # Arabic-Indic
    ("so the answer is \\boxed{७२}.", "72"),       # Devanagari
    ("\\boxed{1\u200b2}", "12"),                   # zero-width space inside the number
    ("\\boxed{\ufeff1\u20602\u200c}", "12"),       # BOM, word joiner, non-joiner
    ("\\boxed{12}", "１２"),                       # the gold's digits too
    ("#### ٣٠", "30"),                             # without a box
    ("\\boxed{٣٫٥}", "3.5"),                       # Arabic decimal separator
    ("\\boxed{١٬٠٠٠}", "1000"),                     # Arabic thousands separator
], ids=["fullwidth", "arabic-indic", "devanagari", "zero-width", "other-invisibles", "gold", "hash-line",
        "arabic-decimal", "arabic-thousands"])
def test_unicode_digits_and_zero_width_characters_score(completion, gold) -> None:
    assert MathAccuracy()([completion], [gold]) == [1.0]


def test_digit_normalization_is_not_nfkc() -> None:
    """Only decimal digits become ASCII: a superscript or a vulgar fraction is another answer."""
    from qerl.answers import normalize_digits

    assert normalize_digits("x² ½ ①, ١٢\u200b3") == "x² ½ ①, 123"
    assert normalize_digits("٣٫٥ and ١٬٠٠٠ but a\u066bb") == "3.5 and 1,000 but a\u066bb"
    assert MathAccuracy()(["\\boxed{2²}", "\\boxed{٧٢}", "\\boxed{٧٣}"], ["22", "72", "72"]) == [0.0, 1.0, 0.0]
    assert extract_answer("the answer is ٧٢") == "72"  # the logged answer is the one scored


def test_integers_past_pythons_int_string_limit_are_compared_as_digits(caplog) -> None:
    """math-verify converts an integer of more than 4300 digits (sys.get_int_max_str_digits) with int()
    and fails: a right answer scored 0 silently. Such integers are compared as digit strings (linear;
    the limit is not raised, so a completion's long number cannot cost quadratic time)."""
    import sys

    n = sys.get_int_max_str_digits() + 700
    big = "12345" * (n // 5)
    reward = MathAccuracy()
    assert reward([f"\\boxed{{{big}}}", f"#### {big}", f"\\boxed{{{big[:-1]}9}}", f"\\boxed{{00{big}}}", "\\boxed{5}"],
                  [big] * 5) == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert reward([f"\\boxed{{{big}}}", f"\\boxed{{-{big}}}"], ["5", f"-{big}"]) == [0.0, 1.0]
    rewards_module._long_integer_warned[0] = False
    with caplog.at_level(logging.WARNING, logger="qerl.rewards"):
        assert reward([f"\\boxed{{{big}.0}}"], [big]) == [0.0]  # not a plain integer: math-verify's, and 0
    assert "a gold integer of" in caplog.text and "int-string limit" in caplog.text
    assert sys.get_int_max_str_digits() == n - 700  # (left as it was)


def test_long_integer_hash_line_with_unit_words() -> None:
    """`#### <5000 digits> dollars` is that integer, compared as digits as a bare one is (math-verify cannot convert it)."""
    import sys

    big = "7" * (sys.get_int_max_str_digits() + 700)
    assert MathAccuracy()([f"#### {big} dollars", f"#### {big[:-1]}8 dollars"], [big] * 2) == [1.0, 0.0]


def test_non_finite_reward_weights_fail_at_construction() -> None:
    """A NaN weight made every sum NaN, which RewardFunction zeroes: no reward at any step, no error."""
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ValueError, match=r"WeightedSum: weights must be finite, got weights\[0\]"):
            WeightedSum([MathAccuracy(), FormatReward()], weights=[bad, 0.2])
    with pytest.raises(ValueError, match="max_chars_after must be >= 0"):
        FormatReward(max_chars_after=-1)


def test_a_box_of_zero_width_characters_is_empty() -> None:
    """`\\boxed{\\u200b}` looks empty and is: no format bonus for an invisible answer."""
    assert FormatReward()(["\\boxed{\u200b}", "\\boxed{\ufeff \u200d}", "\\boxed{1}"], ["1"] * 3) == [0.0, 0.0, 1.0]


# ------------------------------------------------------------------------------------------ R1-style tags
@pytest.mark.parametrize("completion, opened, expected", [
    ("<think>2 + 2 is 4</think>\n<answer>4</answer>", False, 1.0),
    ("  <think>x</think> <answer> 4 </answer>\n", False, 1.0),
    ("2 + 2 is 4</think><answer>4</answer>", True, 1.0),  # the prompt ended with "<think>"
    ("<think>x</think><answer>4</answer>", True, 0.0),  # a second <think>
    ("<think>x</think><answer>4</answer> and more", False, 0.0),  # text after the answer
    ("<think>x</think> so <answer>4</answer>", False, 0.0),  # text between
    ("<answer>4</answer><think>x</think>", False, 0.0),  # wrong order
    ("<think>x</think><answer> \u200b </answer>", False, 0.0),  # empty answer
    ("<think>x</think><answer>4</answer><answer>5</answer>", False, 0.0),  # two answers
    ("<think>x<answer>4</answer>", False, 0.0),  # thought never closed
    ("<think>" * 50_000 + "</answer>" * 50_000, False, 0.0),  # adversarial: linear time
    (None, False, 0.0),
])
def test_tag_format_reward(completion, opened, expected):
    from qerl.rewards import TagFormatReward

    assert TagFormatReward(think_opened_in_prompt=opened).score_one(completion) == expected


def test_math_accuracy_answer_tag_scores_only_the_last_answer_span():
    """The span is read as a box is (math-verify read a bare `2\\sqrt{113}` as 2, `\\pi` as nothing)."""
    reward = MathAccuracy(answer_tag=True)
    for gold in ("\\sqrt{51}", "\\pi", "6 - 5i", "\\left( 3, \\frac{\\pi}{2} \\right)", "\\dfrac{14}{3}"):
        assert reward([f"<think>work</think> <answer>{gold}</answer>"], [gold]) == [1.0], gold
        assert MathAccuracy()([f"<think>work</think> <answer>{gold}</answer>"], [gold]) == [1.0], gold
    assert reward(["<answer>2\\sqrt{113}</answer>"], ["2"]) == [0.0]  # not its leading number
    # a span in words is parsed as text (boxed, math-verify read `The answer is 72` as t*h*E*...*72)
    for span in ("The answer is 72", "Answer: 72", "72 clips", "**72**", "So\n72", "There are 72 apples left",
                 "48 + 24 = 72 clips", "The answer is 72."):
        assert reward([f"<think>w</think> <answer>{span}</answer>"], ["72"]) == [1.0], span
    assert reward(["<answer>\\boxed{72</answer>"], ["72"]) == [0.0]  # an unclosed box is not the number
    assert reward(["<answer>\\text{Evelyn}</answer>"], ["\\text{Evelyn}"]) == [1.0]  # LaTeX text is markup
    assert reward(["<think>maybe 5</think><answer>\\frac{1}{2}</answer>"], ["0.5"]) == [1.0]
    assert reward(["<think>it is \\boxed{4}</think><answer>5</answer>"], ["4"]) == [0.0]  # the box in the thought is not it
    assert reward(["<answer>3</answer> no, <answer>\\boxed{1,000}</answer>"], ["1000"]) == [1.0]
    assert reward(["the answer is 4"], ["4"]) == [0.0]  # no tag
    assert MathAccuracy()(["<think>x</think><answer>4</answer>"], ["4"]) == [1.0]  # without the option: the tail
    assert extract_answer("<think>1 2 3</think><answer> 42 </answer>") == "42"  # the logged answer


@pytest.mark.parametrize("completion", [
    "#### $" + " " * 100_000 + "x", "#### x = $" + " " * 100_000 + "!", "#### -" + " " * 100_000 + "x",
    "\\boxed{\\text{$" + " " * 100_000 + "x}}", "\\boxed{1" + " " * 100_000 + "a}",
    # a long word after a number (unit words: `18 dollars`; 25 s at 100k letters) and unit-symbol runs
    "\\boxed{1 " + "a" * 100_000 + "!}", "\\boxed{1 " + "cm" * 50_000 + "/}", "\\boxed{1 " + "abc^2 " * 20_000 + "/}",
    "\\boxed{1 km/" + "h" * 100_000 + "^}", "\\boxed{1\\text{ " + "a" * 100_000 + "}^}",
])
def test_runs_of_spaces_do_not_backtrack(completion):
    """Two optional-whitespace runs side by side in a regex split a run of spaces every way (#### $ +
    20k spaces took 51 s in the answer-line regex, in C, where no deadline reaches): all linear now."""
    from qerl.math_parsing import starts_with_relation, strip_end_punctuation

    start = time.monotonic()
    assert MathAccuracy(max_chars=200_000)([completion], ["5"]) == [0.0]
    extract_answer(completion)
    strip_end_punctuation("1" + " " * 100_000 + ".")
    starts_with_relation(" " * 100_000 + "x")  # (`\s*\{?\s*`: 8 s on 40k spaces before)
    assert time.monotonic() - start < 10  # (was minutes to hours; linear: ~0.1 s)


@pytest.mark.parametrize("text, expected", [
    ("18.", "18"), ("18 .", "18"), ("18,", "18"), ("0.33...", "0.33..."), ("18, ...", "18, ..."),
    ("x. .", "x. "), ("18", "18"), ("", ""), (".", ""),
])
def test_strip_end_punctuation(text, expected):
    from qerl.math_parsing import strip_end_punctuation

    assert strip_end_punctuation(text) == expected


@pytest.mark.parametrize("completion, answer", [
    ("so \\boxed{1,000} apples", "1,000"),  # the last box, as scored
    ("The answer is 7 or 8 or 9", "7"),  # math-verify's pick from the tail, not the whole phrase
    ("$x = 4$ and $y = 9$", "x = 4 and y = 9"),
    ("Rgjggggjgggjggg7q", None),  # nothing parsed: scored 0
    ("#### 42", "42"),
])
def test_scored_answer_is_what_the_verdict_compared(completion, answer):
    """Reports put this next to the verdict: extract_answer's guess ('7 or 8 or 9', '7' in 'gg7q')
    disagreed with what math-verify scored."""
    assert MathAccuracy().scored_answer(completion) == answer
    assert MathAccuracy(boxed_only=True).scored_answer("no box 42") is None


def test_scored_answer_after_the_score_parses_nothing_again(monkeypatch):
    """Evaluation scores a completion, then shows and votes on its answer: the second read of an
    unboxed completion is a cache hit, not a second math-verify parse (its slowest part)."""
    import qerl.math_parsing as parsing
    calls = []
    real_parse = parsing.math_verify.parse
    monkeypatch.setattr(parsing.math_verify, "parse", lambda *a, **k: calls.append(a) or real_parse(*a, **k))
    scorer = MathAccuracy()
    text = "so the total is 17 + 25 = 4217 apples, i.e. 4217 in all"  # unique: no earlier test's cache entry
    assert scorer.score_one(text, "4217") == 1.0
    parsed = len(calls)
    assert parsed > 0 and scorer.scored_answer(text) == "4217" and len(calls) == parsed


@pytest.mark.parametrize("completion, gold, expected", [
    ("She buys 3 tickets at $6 each, so she pays\n\\[ 18 \\text{ dollars} \\]", "18", 1.0),  # 18*dollars to math-verify
    ("She buys 3 tickets at $6 each, so she pays\n\\[\n18\\text{ dollars}\n\\]", "18", 1.0),
    ("She buys 3 tickets at $6 each, so she pays\n\\[ 18 \\text{ dollars} \\]", "19", 0.0),
    ("She pays\n\\[ 6 \\times 3 = 18 \\text{ dollars} \\]", "6", 0.0),  # not a number with units: no number added
])
def test_unboxed_display_number_with_units(acc: MathAccuracy, completion: str, gold: str, expected: float) -> None:
    assert acc([completion], [gold]) == [expected]
    assert acc.scored_answer(completion).endswith(r"\text{ dollars}")  # the answer shown is math-verify's


@pytest.mark.parametrize("box", ["4219 dollars", r"4219 \text{ dollars}", r"\text{4,219 dollars}"])
def test_a_number_with_unit_words_is_parsed_as_the_number_alone(monkeypatch, box):
    """math-verify parsed `\\boxed{18 dollars}` whole first (a product of symbols, ~8 ms: the slowest box a GSM8K
    model writes) and only then the number; the number alone is the box's reading."""
    import qerl.math_parsing as parsing
    calls = []
    real_parse = parsing.math_verify.parse
    monkeypatch.setattr(parsing.math_verify, "parse", lambda *a, **k: calls.append(a[0]) or real_parse(*a, **k))
    assert MathAccuracy().score_one(f"So she makes $\\boxed{{{box}}}$ a month.", "4219") == 1.0
    assert calls and not any("dollars" in text for text in calls)


def test_a_gold_without_an_expression_is_warned(caplog):
    """`#### \\frac{` loads (it is text), but math-verify reads no expression in it: every completion
    of that prompt scores 0 unless it repeats it verbatim -- now said, not silent."""
    reward_function._warn_state["last"] = 0.0
    with caplog.at_level(logging.WARNING, logger="qerl.rewards"):
        assert MathAccuracy()(["\\boxed{\\frac{1}{2}}"], ["\\frac{"]) == [0.0]
    assert "reads no expression in the gold answer '\\\\frac{'" in caplog.text


@pytest.mark.parametrize("completion, expected", [
    ("<think>x</think> <answer>4</answer>", 1.0),
    ("Sure! <think>x</think>\n<answer>4</answer> and then some text", 1.0),  # contained is enough
    ("<think>x</think> so <answer>4</answer>", 0.0),  # text between the two
    ("<think>a</think> b </think><answer>4</answer>", 1.0),  # a later </think> pairs with the answer
    ("<answer>4</answer><think>x</think>", 0.0),
    ("<think>x</think><answer>4", 0.0),
    ("<think>" + "</think> x " * 50_000 + "</answer>", 0.0),  # adversarial: linear
])
def test_tag_format_reward_soft_is_the_official_regex(completion, expected):
    """strict: false is the official QeRL soft_format_reward: `<think>.*?</think>\\s*<answer>.*?</answer>`
    searched (checked equal to that regex on 200k random tag strings when written)."""
    import re

    from qerl.rewards import TagFormatReward

    assert TagFormatReward(strict=False).score_one(completion) == expected
    assert bool(re.search(r"<think>.*?</think>\s*<answer>.*?</answer>", completion, re.DOTALL)) == bool(expected)


@pytest.mark.parametrize("completion, gold, expected", [
    # words after a boxed number that make it another answer or none: math-verify alone keeps the number
    ("\\boxed{70\\text{ thousand dollars}}", "70", 0.0),
    ("\\boxed{70\\text{ thousand dollars}}", "70000", 0.0),  # as \text{70 thousand dollars} (not read as 70000)
    ("\\boxed{18 \\text{ is wrong}}", "18", 0.0),
    ("\\boxed{17\\text{ or more}}", "17", 0.0),
    ("\\boxed{18 \\text{ dollars}}", "18", 1.0),
    ("\\boxed{5.4 \\text{ cents}}", "5.4 \\text{ cents}", 1.0),  # (MATH-500's one gold with unit words)
    # R1-style answer spans and a last #### line in words are held to the #### line's hedge rule
    ("<think>.</think><answer>72 is not correct</answer>", "72", 0.0),
    ("<answer>71 or 72</answer>", "72", 0.0),
    ("<answer>The answer is 72</answer>", "72", 1.0),
    ("So 72.\n#### It is not 72", "72", 0.0),
    ("#### either 71 or 72\n", "72", 0.0),
    ("#### The answer is 72", "72", 1.0),
    ("#### Step 1: not sure yet\nso the answer is 72", "72", 1.0),  # a heading in the reasoning, not the end
    # a mixed-unit quantity with LaTeX spacing is still not its first number
    ("\\boxed{2\\,\\text{h}\\,30\\,\\text{min}}", "2", 0.0),
    ("\\boxed{2\\text{ h}\\quad 30\\text{ min}}", "2", 0.0),
    # a Unicode minus inside a box as after ####; a range's dash is no minus
    ("\\boxed{\u20133}", "-3", 1.0),
    ("\\boxed{\u22123}", "-3", 1.0),
    ("\\boxed{1\u20133}", "-2", 0.0),
    # decimals compared to the places written (math-verify's default rounds both to 6)
    ("\\boxed{0.0000673}", ".0000672", 0.0),   # MATH-500 row 176's gold
    ("\\boxed{0.000067}", ".0000672", 0.0),
    ("\\boxed{0.0000672}", ".0000672", 1.0),
    ("\\boxed{6.72\\times 10^{-5}}", ".0000672", 1.0),
    ("\\boxed{0.0000014}", "0.000001", 0.0),
    ("\\boxed{\\frac{1}{3}}", "0.333333", 1.0),   # math-verify's own case stays
    ("The answer is 0.0000673.", ".0000672", 0.0),
    # a negative dollar amount in running text (math-verify reads `-$3` as nothing)
    ("The answer is -$3.", "-3", 1.0),
    ("So she has -\\$3 left.", "-3", 1.0),
    ("The answer is -$3.", "3", 0.0),
    ("Total: $10-$3 = $7", "7", 1.0),   # a minus after a value is a subtraction, left alone
])
def test_answers_that_deny_hedge_or_round_their_number_are_not_it(completion, gold, expected):
    assert MathAccuracy(answer_tag="<answer>" in completion).score_one(completion, gold) == expected


def test_float_rounding_follows_the_places_written():
    from qerl.math_parsing import float_rounding

    assert float_rounding("72", "\\frac{1}{3}") == 6 and float_rounding("0.5", "3.25") == 6
    assert float_rounding(".0000672", "0.5") == 7 and float_rounding("1", "x = 0.12345678") == 8


def test_math_verify_timeout_disabled_notice_is_dropped_and_its_other_lines_pass(caplog):
    """qerl.rewards disables math-verify's own timeout on purpose (qerl.deadline bounds it instead), so
    the notice that the timeout is disabled would only mislead; math-verify's other records still show
    (the filter is installed when ``rewards_module`` is imported)."""
    for name in ("math_verify.parser", "math_verify.grader"):
        caplog.clear()
        with caplog.at_level("WARNING"):
            logging.getLogger(name).warning("Timeout is disabled as timeout_seconds is <= 0")
            logging.getLogger(name).warning("could not parse the gold")
        assert [r.getMessage() for r in caplog.records] == ["could not parse the gold"], name
