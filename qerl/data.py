"""Prompt data for math RL: load question/answer pairs (their prompt ids: `qerl.prompts`).

Pure Python (no Lightning); `lightning_modules.data.PromptDataModule` wraps it for the Trainer.

Sources (`load_examples`):

* a local ``.jsonl`` / ``.json`` / ``.parquet`` file;
* a local directory: ``<dir>/<split>.{jsonl,json,parquet}`` if present, else a
  ``Dataset.save_to_disk`` folder, else anything ``datasets.load_dataset(<dir>)`` understands
  (e.g. a downloaded Hugging Face dataset repo with ``data/<split>-*.parquet``); ``"<dir>:config"``
  picks a config of a downloaded multi-config repo (``gsm8k/:main``);
* a Hugging Face dataset id, optionally ``"id:config"`` (``"openai/gsm8k:main"``), loaded with
  ``datasets.load_dataset(id, config, split=split)``;
* ``"synthetic-arithmetic"``: generated "What is 7 + 5?" problems (no files, for smoke tests).

Field layouts (`Layout`): ``gsm8k`` (``question`` + ``answer`` ending in ``#### 72``, or a short
one-line ``answer`` as in AMC / AIME sets; the gold is the text after ``####`` without ``$`` or
thousands separators), ``math`` (``problem`` + ``answer``, or the last
``\\boxed{}`` of ``solution`` when there is no ``answer``), ``custom`` (``prompt_key`` +
``answer_key``), and ``auto`` (detected from the first row whose keys match one of the above;
explicit keys mean ``custom``). Every layout honours ``prompt_key``/``answer_key`` overrides.

Bad rows (invalid JSON or UTF-8, text with a lone surrogate, missing or empty fields, a NaN or
infinite number, e.g. JSON's ``1e400``) are skipped with a warning naming the line/row, and counted (`LoadedExamples.num_skipped`); only a
source with no usable row at all is an error.
"""

from __future__ import annotations

import logging
import math
import random
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal

from qerl.answers import extract_boxed, extract_gsm8k_gold
from qerl.data_sources import LOCAL_SUFFIXES, SPLIT_WORDS, BadRow as _BadRow, raw_rows as _raw_rows
from qerl.prompts import DEFAULT_SYSTEM_PROMPT, build_prompt_ids, encode_prompts  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

SYNTHETIC_SOURCE = "synthetic-arithmetic"
# Rows generated for `synthetic-arithmetic` when no limit is given.
SYNTHETIC_DEFAULT_SIZE = 1024
Layout = Literal["auto", "gsm8k", "math", "custom"]
_LAYOUTS = ("auto", "gsm8k", "math", "custom")
# At most this many per-row warnings per load; the rest are only counted in the summary.
_MAX_ROW_WARNINGS = 10
_MAX_BARE_ANSWER = 64  # a GSM8K-layout answer without '####' must be this short (one line) to count as the answer


@dataclass
class PromptExample:
    """One RL prompt: the question text, its parsed gold answer, and where it came from.

    Attributes:
        prompt: The question / problem text (the user message; no chat formatting).
        answer: The gold answer, already parsed to a short string ("72", "\\frac{1}{2}").
        source: The source string it was loaded from (path, dataset id or ``synthetic-arithmetic``).
        index: The row's 0-based position in that source (malformed rows keep their index).
    """

    prompt: str
    answer: str
    source: str
    index: int


class LoadedExamples(list):
    """A ``list[PromptExample]`` that also records how many source rows were skipped as malformed."""

    def __init__(self, examples: Iterable[PromptExample] = (), num_rows: int = 0, num_skipped: int = 0):
        super().__init__(examples)
        self.num_rows = num_rows
        self.num_skipped = num_skipped


# ----------------------------------------------------------------------------------------------
# Answer parsing
# ----------------------------------------------------------------------------------------------


def _as_text(value: Any, key: str = "") -> str:
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        # `answer: true` or `answer: ["5"]` would otherwise become the gold "True" / "['5']"
        raise _BadRow(f"field {key!r} is a {type(value).__name__} ({str(value)[:40]}), not text or a number")
    if isinstance(value, float):
        if math.isnan(value):  # (a pandas / parquet missing value, or JSON's `NaN`)
            raise _BadRow(f"field {key!r} is NaN (a missing value), not an answer")
        if not math.isfinite(value):  # JSON's `1e400` overflows to inf: no gold is "inf"
            raise _BadRow(f"field {key!r} is a non-finite number ({value}; JSON's 1e400 overflows a float)")
        return _float_text(value)
    text = str(value).strip()
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        # a lone surrogate (JSON `"\ud83d"`, half an emoji) loads, but the tokenizer raises an opaque
        # TypeError on it later and that would end the whole dataloader
        raise _BadRow(f"field {key!r} is not valid Unicode (lone surrogate {text[e.start]!r} at "
                      f"character {e.start + 1})") from None
    return text


def _float32(value: float) -> float | None:
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return None


def _float_text(value: float) -> str:
    """A numeric answer as a person writes it: positional (``5e-05`` → ``0.00005``: math-verify
    reads ``5e-05`` as e − 5), integers without ``.0``, and a float32 column's value by its own
    shortest digits (``123.44999694824219`` → ``123.45``). A finite value (`_as_text` skips the row
    of a NaN or an infinity, each with its own reason)."""
    if value.is_integer():  # (by its shortest digits: str(int(1e23)) is 99999999999999991611392)
        return format(Decimal(repr(value)).to_integral_value(), "f") if value else "0"  # (-0.0: 0)
    text = repr(value)
    if _float32(value) == value:  # a float32 column widened to float64: its shortest float32 digits
        text = next(t for digits in range(1, 10) if _float32(float(t := f"{value:.{digits}g}")) == value)
    return format(Decimal(text), "f")


def _missing_as_none(value: Any, fallback: bool) -> Any:
    """``value``, or None for a NaN (a parquet column's missing value) when the row has a ``fallback``
    (a MATH row's ``solution``, whose box is then the answer)."""
    return None if fallback and isinstance(value, float) and math.isnan(value) else value


def _is_bare_answer(text: str) -> bool:
    """A one-line answer short enough to be the answer itself, not a worked solution; or an integer
    of any length (a JSON integer longer than ``int()`` converts is read as its digits)."""
    return bool(text) and "\n" not in text.strip() and (len(text) <= _MAX_BARE_ANSWER or bool(_INTEGER.fullmatch(text)))


_INTEGER = re.compile(r"[-+]?\d+")


# ----------------------------------------------------------------------------------------------
# Layouts
# ----------------------------------------------------------------------------------------------


def detect_layout(row: Mapping[str, Any], prompt_key: str | None = None, answer_key: str | None = None) -> str | None:
    """``"gsm8k"`` / ``"math"`` from a row's keys, or None if neither matches; a given ``prompt_key`` /
    ``answer_key`` stands for that layout's own name (``input`` + ``answer: "#### 5"``: gsm8k)."""
    answer_field = answer_key or "answer"
    if (prompt_key or "question") in row and answer_field in row:
        answer = _as_text(row[answer_field], answer_field)
        if "####" in answer or _is_bare_answer(answer):  # GSM8K, or a short-answer set (AMC, AIME)
            return "gsm8k"
    if (prompt_key or "problem") in row and (answer_field in row or (answer_key is None and "solution" in row)):
        return "math"
    return None


def _field(row: Mapping[str, Any], key: str, prompt: bool = False) -> str:
    """The text of ``row[key]``; an answer may also be a number, a ``prompt`` must be text."""
    if key not in row:
        raise _BadRow(f"missing field {key!r} (row has {sorted(row)})")
    if prompt and row[key] is not None and not isinstance(row[key], str):  # (`question: 5` is no question)
        raise _BadRow(f"prompt field {key!r} is not text ({type(row[key]).__name__} {str(row[key])[:40]})")
    text = _as_text(row[key], key)
    if not text:
        raise _BadRow(f"empty field {key!r}")
    return text


def _row_to_pair(row: Any, layout: str, prompt_key: str | None, answer_key: str | None) -> tuple[str, str]:
    """(prompt, parsed answer) of one row in a resolved layout; raises _BadRow."""
    if not isinstance(row, Mapping):
        raise _BadRow(f"expected a JSON object, got {type(row).__name__}")
    if layout == "gsm8k":
        prompt = _field(row, prompt_key or "question", prompt=True)
        raw = _field(row, answer_key or "answer")
        if "####" not in raw and not _is_bare_answer(raw):
            # a worked solution without its '#### <answer>' line: the gold would be the whole text
            raise _BadRow("GSM8K answer has no '#### <final answer>' line")
        answer = extract_gsm8k_gold(raw)
    elif layout == "math":
        prompt = _field(row, prompt_key or "problem", prompt=True)
        if answer_key is not None:
            raw = _field(row, answer_key)
            answer = extract_boxed(raw) or raw
        elif _as_text(_missing_as_none(row.get("answer"), "solution" in row), "answer"):
            answer = _as_text(row["answer"], "answer")
        elif "solution" in row:
            answer = extract_boxed(_as_text(row["solution"], "solution")) or ""
            if not answer:
                raise _BadRow("no 'answer' field and no \\boxed{} in 'solution'")
        elif "answer" in row:  # null or blank (a NaN: `_as_text` names it)
            raise _BadRow("empty field 'answer' and no 'solution'")
        else:
            raise _BadRow(f"missing field 'answer' or 'solution' (row has {sorted(row)})")
    elif layout == "custom":
        if not prompt_key or not answer_key:
            raise ValueError("layout='custom' needs both prompt_key and answer_key")
        prompt = _field(row, prompt_key, prompt=True)
        raw = _field(row, answer_key)
        # A full worked solution is reduced to its final answer; a short answer is kept as is.
        answer = extract_gsm8k_gold(raw) if "####" in raw else (extract_boxed(raw) or raw)
    else:
        raise ValueError(f"unknown layout {layout!r}; use one of {_LAYOUTS}")
    if not prompt:
        raise _BadRow("empty prompt")
    if not answer:
        raise _BadRow("empty answer")
    return prompt, answer


# ----------------------------------------------------------------------------------------------
# Public loaders
# ----------------------------------------------------------------------------------------------


def load_examples(
    source: str,
    split: str = "train",
    layout: Layout = "auto",
    prompt_key: str | None = None,
    answer_key: str | None = None,
    limit: int | None = None,
) -> LoadedExamples:
    """Load prompt/answer pairs from a file, directory, Hugging Face dataset id or the synthetic set.

    Args:
        source: A ``.jsonl``/``.json``/``.parquet`` path, a directory, a Hugging Face dataset id
            (``"openai/gsm8k:main"`` selects config ``main``), or ``"synthetic-arithmetic"``.
        split: Split to load from a directory or dataset id (``<dir>/<split>.jsonl`` etc.); a
            single file is taken whole. For the synthetic set, the split picks the seed
            (``train`` → 0, anything else → a different fixed seed), and the other splits hold
            none of the problems of the default-size train set (``SYNTHETIC_DEFAULT_SIZE``).
        layout: ``auto`` / ``gsm8k`` / ``math`` / ``custom`` (see the module docstring).
        prompt_key: Field holding the question (required for ``custom``; overrides the default).
        answer_key: Field holding the answer (required for ``custom``; overrides the default).
        limit: Keep only the first ``limit`` usable examples (None: all).

    Returns:
        A list of `PromptExample` (a `LoadedExamples`, which also carries ``num_rows`` and
        ``num_skipped``).

    Raises:
        FileNotFoundError: A local path that does not exist.
        ValueError: Unknown layout, undetectable layout, or no usable row at all.
    """
    if layout not in _LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; use one of {_LAYOUTS}")
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be positive or None, got {limit}")
    if source == SYNTHETIC_SOURCE:
        if split == "train":
            examples = synthetic_arithmetic(limit or SYNTHETIC_DEFAULT_SIZE, seed=0)
        else:  # held out: none of the (default-size) train set's problems
            train = frozenset(e.prompt for e in synthetic_arithmetic(SYNTHETIC_DEFAULT_SIZE, seed=0))
            examples = synthetic_arithmetic(limit or SYNTHETIC_DEFAULT_SIZE, seed=1 + sum(map(ord, split)), exclude=train)
        return LoadedExamples(examples, num_rows=len(examples))

    resolved: str | None = None
    if layout != "auto":
        resolved = layout
    elif prompt_key and answer_key:
        resolved = "custom"
    examples = LoadedExamples()
    num_rows = 0
    errors: list[str] = []
    for index, where, row in _raw_rows(source, split):
        num_rows += 1
        try:
            if isinstance(row, _BadRow):
                raise row
            if resolved is None:
                if not isinstance(row, Mapping):
                    raise _BadRow(f"expected a JSON object, got {type(row).__name__}")
                resolved = detect_layout(row, prompt_key, answer_key)
                if resolved is None:
                    raise _BadRow(
                        f"cannot detect the layout from keys {sorted(row)}; expected question+answer"
                        " ('#### ...') or problem+answer/solution, or set layout='custom' with"
                        " prompt_key/answer_key"
                    )
            prompt, answer = _row_to_pair(row, resolved, prompt_key, answer_key)
        except _BadRow as e:
            errors.append(f"{where}: {e}")
            if len(errors) <= _MAX_ROW_WARNINGS:
                logger.warning("skipping malformed row %s: %s", where, e)
            continue
        examples.append(PromptExample(prompt=prompt, answer=answer, source=source, index=index))
        if limit is not None and len(examples) >= limit:
            break
    examples.num_rows = num_rows
    examples.num_skipped = len(errors)
    if not examples:
        detail = f"; first error: {errors[0]}" if errors else ""
        raise ValueError(f"no usable examples in {source!r} (split {split!r}): {num_rows} rows read{detail}")
    if errors:
        logger.warning(
            "%s: skipped %d malformed of %d rows (%d shown above)",
            source,
            len(errors),
            num_rows,
            min(len(errors), _MAX_ROW_WARNINGS),
        )
    return examples


def synthetic_arithmetic(n: int, seed: int, max_operand: int = 20, exclude: frozenset[str] = frozenset()) -> list[PromptExample]:
    """``n`` problems like "What is 7 + 5?" (``+``, ``-``, ``*`` on 0..max_operand), answers ``str(int)``.

    Deterministic in ``seed`` (Python's ``random.Random``; no global RNG is touched). Prompts in
    ``exclude`` are redrawn (the held-out splits leave out the train set's problems).
    """
    rng = random.Random(seed)
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    if len(exclude) >= 3 * (max_operand + 1) ** 2:
        raise ValueError("synthetic_arithmetic: every problem is excluded")
    out = []
    while len(out) < n:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-*")
        prompt = f"What is {a} {op} {b}?"
        if prompt not in exclude:
            out.append(PromptExample(prompt=prompt, answer=str(ops[op](a, b)), source=SYNTHETIC_SOURCE, index=len(out)))
    return out


def source_names(sources: list[str]) -> dict[str, str]:
    """Short, distinct names for training sources (the tags of per-source curves): the last part
    of the path or dataset id without its suffix, with its folder when it only names the split
    (``data/gsm8k/train.jsonl`` -> ``gsm8k_train``, ``openai/gsm8k`` -> ``gsm8k``); names that
    would collide keep more of the path, and what still collides is numbered."""
    def parts(source: str) -> list[str]:
        path = source.rstrip("/")
        for suffix in LOCAL_SUFFIXES:
            path = path[: -len(suffix)] if path.lower().endswith(suffix) else path
        return [p for p in path.split("/") if p not in ("", ".", "..")] or [source]

    unique = list(dict.fromkeys(sources))
    split = {s: parts(s) for s in unique}
    depth = {s: 2 if len(split[s]) > 1 and split[s][-1].lower() in SPLIT_WORDS else 1 for s in unique}
    while True:
        names = {s: "_".join(split[s][-depth[s]:]) for s in unique}
        taken = list(names.values())
        grow = [s for s in unique if taken.count(names[s]) > 1 and depth[s] < len(split[s])]
        if not grow:
            break
        for s in grow:
            depth[s] += 1
    taken = set(names.values())  # every natural name is reserved: a clash's later members number on
    first = {}
    for s in unique:
        first.setdefault(names[s], s)
    for s in unique:
        if first[names[s]] == s:
            continue
        name, k = names[s], 1
        while name in taken:
            k += 1
            name = f"{names[s]}_{k}"
        names[s] = name
        taken.add(name)
    return names
