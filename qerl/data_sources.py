"""Where prompt rows come from: local ``.jsonl`` / ``.json`` / ``.parquet`` files, local directories
(``<split>.<ext>``, ``save_to_disk`` folders, downloaded dataset repos) and Hugging Face dataset ids
(``"id:config"``). Yields raw rows with a name for messages; ``qerl.data`` turns them into examples.
A row that cannot be parsed is yielded as a :class:`BadRow` (skipped and counted there). A ``.json``
file is a list of rows, an object holding one list of rows, one row, or JSON Lines."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from qerl.hub_offline import go_offline_if_hub_unreachable

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


class BadRow(ValueError):
    """A row that cannot become a PromptExample (invalid JSON, missing/empty field)."""



# A raw row: (position in the source, what it is called in messages, the row or the parse error).
_RawRow = tuple[int, str, Any]


_INVALID_UTF8 = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" makes of a bad byte
_LINE_END = re.compile(r"\r\n?|\n")  # the line ends that reading a file in text mode splits at


def _read_jsonl(path: Path) -> Iterator[_RawRow]:
    index = 0
    # undecodable bytes become lone surrogates: one line of broken UTF-8 is one bad row, not the file
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            # a byte-order mark inside the file, where files saved with one were joined (`cat a b`)
            line = line.removeprefix("\ufeff")
            row: Any
            if bad := _INVALID_UTF8.search(line):
                row = BadRow(f"invalid UTF-8 (byte {ord(bad.group()) - 0xDC00:#04x} at column {bad.start() + 1})")
            else:
                try:
                    row = _loads(line)
                except json.JSONDecodeError as e:
                    # (the line without its newline: a truncated row's error is then at its end, not
                    # at "column 1" of the line after it)
                    e = _json_error(line.rstrip("\r\n")) or e
                    row = BadRow(f"invalid JSON ({e.msg} at column {e.colno})")
            yield index, f"{path}:{lineno}", row
            index += 1


def _int_or_text(digits: str) -> int | str:
    """A JSON integer as an int, or as its digits where it is longer than Python converts
    (``sys.get_int_max_str_digits()``: json.loads would raise, and one such answer ended the whole
    load); MathAccuracy compares such long integers as digit strings."""
    limit = sys.get_int_max_str_digits()
    return digits if limit and len(digits.lstrip("-")) > limit else int(digits)


def _loads(text: str) -> Any:
    """``json.loads``, with integers too long for ``int()`` kept as their digits (`_int_or_text`), and
    nesting deeper than Python's recursion limit a JSONDecodeError (a RecursionError ended the load)."""
    try:
        return json.loads(text, parse_int=_int_or_text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text, 0) from None


def _json_error(text: str) -> json.JSONDecodeError | None:
    try:
        _loads(text)
    except json.JSONDecodeError as e:
        return e
    return None


def _looks_like_json_lines(text: str) -> bool:
    """Whether a ``.json`` file that is not one JSON document is JSON Lines (common on the Hub), some
    rows broken: at least two non-blank lines, at least half of them JSON on their own. A broken
    pretty-printed document (lines like ``[`` or ``"a": 1,``) is not, and keeps its own error."""
    lines = [line.removeprefix("\ufeff") for line in _LINE_END.split(text) if line.strip()]
    return len(lines) > 1 and 2 * sum(_json_error(line) is None for line in lines) >= len(lines)


# A top-level object with one of these as text is a row itself, whatever lists of objects it holds
# (``{"problem": ..., "answer": ..., "hints": [{...}]}``).
_ROW_TEXT_KEYS = ("question", "problem", "prompt")


def _column_oriented(data: Mapping) -> bool:
    """pandas' ``to_json`` layouts other than records: ``{"col": {"0": v, ...}}`` (columns), ``{"columns":
    [...], "data": [[...]]}`` (split), or one list of plain values per field (``{"question": [...]}``)."""
    values = list(data.values())
    if {"columns", "data"} <= set(data):
        return True
    if values and all(isinstance(v, Mapping) and v for v in values):
        return True
    return bool(values) and all(isinstance(v, list) and v and not any(isinstance(x, Mapping) for x in v) for v in values)


def _row_list(data: Any, path: Path) -> list:
    """The rows of a parsed ``.json`` document: a list of rows, an object holding exactly one non-empty
    list of objects (``{"data": [...]}``, maybe beside metadata and empty lists), or else one object
    that is one row (always so when it has a ``question`` / ``problem`` / ``prompt`` text)."""
    if isinstance(data, Mapping):
        if any(isinstance(data.get(k), str) for k in _ROW_TEXT_KEYS):
            return [data]
        rows = list(data.values())
        if rows and all(isinstance(r, Mapping) and any(isinstance(r.get(k), str) for k in _ROW_TEXT_KEYS) for r in rows):
            return rows  # pandas' orient="index": {"0": {row}, "1": {row}}
        if _column_oriented(data):
            raise ValueError(f"{path}: column-oriented JSON (pandas' default `to_json`, or one list per field): "
                             "write one object per row, e.g. df.to_json(path, orient='records', lines=True)")
        lists = [v for v in data.values() if isinstance(v, list) and v and all(isinstance(r, Mapping) for r in v)]
        if len(lists) > 1:
            raise ValueError(f"{path}: expected a JSON list of rows (or an object holding exactly one list of rows, "
                             f"not {len(lists)})")
        return lists[0] if lists else [data]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of rows, got {type(data).__name__}")
    return data


def _read_json(path: Path) -> Iterator[_RawRow]:
    # undecodable bytes become lone surrogates, as in `_read_jsonl`, so they can be reported by position
    text = path.read_bytes().decode("utf-8-sig", errors="surrogateescape")
    try:
        data, error = _loads(text), None
    except json.JSONDecodeError as e:
        if _looks_like_json_lines(text):  # JSON Lines saved as .json: a broken line is one bad row
            yield from _read_jsonl(path)
            return
        data, error = None, e
    if bad := _INVALID_UTF8.search(text):
        line = text.count("\n", 0, bad.start()) + 1
        column = bad.start() - (text.rfind("\n", 0, bad.start()) + 1) + 1
        raise ValueError(f"{path}: invalid UTF-8 (byte {ord(bad.group()) - 0xDC00:#04x} at line {line}, "
                         f"column {column}); save the file as UTF-8")
    if error is not None:
        raise ValueError(f"{path}: not valid JSON ({error.msg} at line {error.lineno})") from None
    for i, row in enumerate(_row_list(data, path)):
        yield i, f"{path}[{i}]", row


def _read_table(rows: Iterable[Any], name: str) -> Iterator[_RawRow]:
    for i, row in enumerate(rows):
        yield i, f"{name} row {i}", row


def _read_parquet(path: Path) -> Iterator[_RawRow]:
    import pyarrow.parquet as pq

    yield from _read_table(pq.read_table(path).to_pylist(), str(path))


def _pick_split(ds: Any, split: str, name: str) -> Any:
    """A `datasets.Dataset` from a Dataset or DatasetDict."""
    if isinstance(ds, Mapping):  # DatasetDict
        if split not in ds:
            raise ValueError(f"{name} has no split {split!r} (available: {sorted(ds.keys())})")
        return ds[split]
    return ds


# Names `datasets` reads as a split: a lower-case split word at the start or after a separator, and
# before one or the end (`train.jsonl`, `test-00000-of-00001.parquet`, `gsm8k_test.jsonl`, `data.val.json`;
# not `Train.jsonl`, which datasets reads as an unnamed file of the train split).
SPLIT_WORDS = ("train", "training", "test", "testing", "eval", "evaluation", "valid", "validation", "dev", "val")
_SPLIT_NAMED = re.compile(rf"(?:^|[-._ 0-9])(?:{'|'.join(SPLIT_WORDS)})(?:[-._ 0-9]|$)")


def _read_directory(path: Path, split: str, config: str | None = None) -> Iterator[_RawRow]:
    """``<dir>/<split>.{jsonl,json,parquet}``; else a ``save_to_disk`` folder; else data files at the
    top level whose names are no split (``a.jsonl``, ``b.parquet``): all of them, in name order, as
    the ``train`` split, each through our own readers (a malformed row is a skipped row, and mixed
    file types all count: ``datasets`` read only one type and failed on one bad line); else a Hub
    repo layout through ``datasets.load_dataset``, whose errors name the folder."""
    saved = False
    if config is None:
        for suffix in LOCAL_SUFFIXES:
            candidate = path / f"{split}{suffix}"
            if candidate.is_file():
                yield from _read_file(candidate)
                return
        saved = (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
        files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix.lower() in LOCAL_SUFFIXES)
        if not saved and files and not any(_SPLIT_NAMED.search(f.stem) for f in files):
            if split != "train":
                raise ValueError(f"{path}: no {split!r} split (its data files, {files[0].name}"
                                 f"{' ...' if len(files) > 1 else ''}, are one training set; give the file, or name "
                                 f"it {split}.jsonl)")
            offset = 0  # rows numbered through the files: (source, index) names one row (DDP merge, refills)
            for f in files:
                count = 0
                for index, where, row in _read_file(f):
                    yield offset + index, where, row
                    count = index + 1
                offset += count
            return
    import datasets

    try:
        if config is not None:  # a downloaded multi-config dataset repo (`gsm8k/:main`)
            ds = datasets.load_dataset(str(path), config, split=split)
        elif saved:
            ds = _pick_split(datasets.load_from_disk(str(path)), split, str(path))
        else:
            ds = datasets.load_dataset(str(path), split=split)
    except ValueError as err:
        if str(path) in str(err):
            raise
        raise ValueError(f"{path}{':' + config if config else ''}: {_first_line(err)}") from err
    except Exception as err:  # noqa: BLE001 (datasets' DatasetGenerationError on a malformed file, ...)
        raise ValueError(f"{path}{':' + config if config else ''}: datasets could not load it "
                         f"({type(err).__name__}: {_first_line(err)}{_cause(err)})") from err
    yield from _read_table(ds, f"{path}:{config}" if config else str(path))


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]


def _cause(err: BaseException) -> str:
    """What a wrapping exception hides (datasets' "An error occurred while generating the dataset")."""
    cause = err.__cause__ or err.__context__
    return f"; {type(cause).__name__}: {_first_line(cause)}" if cause is not None and str(cause) else ""


def _read_file(path: Path) -> Iterator[_RawRow]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _read_jsonl(path)
    elif suffix == ".json":
        yield from _read_json(path)
    elif suffix == ".parquet":
        yield from _read_parquet(path)
    else:
        raise ValueError(f"{path}: unsupported file type {suffix!r}; use one of {LOCAL_SUFFIXES}")


def _looks_local(source: str) -> bool:
    return (
        source.lower().endswith(LOCAL_SUFFIXES)
        or source.startswith(("/", "./", "../", "~"))
        or os.sep != "/" and os.sep in source
    )


def _read_hub(source: str, split: str) -> Iterator[_RawRow]:
    import datasets

    dataset_id, _, config = source.partition(":")
    go_offline_if_hub_unreachable()  # offline, a cached dataset loads at once instead of after retries
    try:
        ds = datasets.load_dataset(dataset_id, config or None, split=split)
    except Exception as err:  # offline, unknown id, or a local path that does not exist
        raise FileNotFoundError(f"data source {source!r}: no such local file or directory, and loading it as a "
                                f"Hugging Face dataset failed ({type(err).__name__}: {_first_line(err)})") from err
    yield from _read_table(_pick_split(ds, split, source), source)


def raw_rows(source: str, split: str) -> Iterator[_RawRow]:
    """(index, name, row or BadRow) of every row of ``source``; missing local paths raise."""
    path = Path(source).expanduser()
    folder, _, config = str(source).rpartition(":")
    if path.is_dir():
        yield from _read_directory(path, split)
    elif folder and config and Path(folder).expanduser().is_dir():
        yield from _read_directory(Path(folder).expanduser(), split, config)
    elif path.is_file():
        yield from _read_file(path)
    elif _looks_local(source):
        raise FileNotFoundError(f"data source not found: {path}")
    else:
        yield from _read_hub(source, split)
