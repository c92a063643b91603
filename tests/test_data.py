"""Prompt data: loaders and layouts (qerl.data) and the resumable PromptDataModule."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from lightning_modules.data import BATCH_KEYS, PromptDataModule, epoch_permutation
from qerl import data as qdata
from qerl import prompts as qprompts
from qerl.data import (
    DEFAULT_SYSTEM_PROMPT,
    build_prompt_ids,
    load_examples,
    source_names,
    synthetic_arithmetic,
)
from qerl.answers import extract_boxed, extract_gsm8k_gold
from qerl.tiny import build_tiny_tokenizer

GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
        " How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips"
        " altogether in April and May.\n#### 72",
    },
    {
        "question": "A company pays $1,000 per worker per month for 1.08 workers per desk. What is the cost?",
        "answer": "It costs 1000 * 1.08 = <<1000*1.08=1080>>1080 dollars.\n#### $1,080",
    },
    {"question": "Tom has -3 apples. How many?", "answer": "He has -3.\n#### -3"},
]
MATH_ROWS = [
    {
        "problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
        "solution": "We have $r = 3$, so the answer is $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$",
        "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
        "subject": "Precalculus",
        "level": 2,
    },
    {
        # No `answer` field: the gold is the last \boxed{} of the solution (balanced braces).
        "problem": "What is the probability that a fair coin lands heads?",
        "solution": "There are $\\boxed{2}$ outcomes, one of them heads, so it is $\\boxed{\\frac{1}{2}}$.",
    },
]


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


# ------------------------------------------------------------------------------------------ parsing


def test_answer_parsing_helpers():
    assert extract_gsm8k_gold("blah\n#### 1,080") == "1080"
    assert extract_gsm8k_gold("#### $ 5") == "5"
    assert extract_gsm8k_gold("#### 3, 4") == "3, 4" and extract_gsm8k_gold("(1,2)") == "(1,2)"  # not thousands
    assert extract_boxed("so $\\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{1} then \\boxed {x^{2}}") == "x^{2}"
    assert extract_boxed("\\boxed{a \\{ b \\}}") == "a \\{ b \\}"
    assert extract_boxed("\\boxed{unclosed") is None
    assert extract_boxed("no box") is None


def test_gsm8k_layout(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    for layout in ("auto", "gsm8k"):
        ex = load_examples(path, layout=layout)
        assert [e.answer for e in ex] == ["72", "1080", "-3"]
        assert ex[0].prompt == GSM8K_ROWS[0]["question"]
        assert [e.index for e in ex] == [0, 1, 2]
        assert all(e.source == path for e in ex)
        assert ex.num_skipped == 0


def test_math_layout_boxed_fallback(tmp_path):
    path = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    for layout in ("auto", "math"):
        ex = load_examples(path, layout=layout)
        assert [e.answer for e in ex] == ["\\left( 3, \\frac{\\pi}{2} \\right)", "\\frac{1}{2}"]
        assert ex[1].prompt.startswith("What is the probability")


def test_custom_layout_and_auto_failure(tmp_path):
    rows = [{"prompt": "What is 2 + 2?", "solution": "4"}, {"prompt": "Half of 1?", "solution": "\\boxed{\\frac12}"}]
    path = write_jsonl(tmp_path / "bigmath.jsonl", rows)
    ex = load_examples(path, layout="custom", prompt_key="prompt", answer_key="solution")
    assert [e.answer for e in ex] == ["4", "\\frac12"]
    # Explicit keys with layout=auto mean custom.
    assert [e.answer for e in load_examples(path, prompt_key="prompt", answer_key="solution")] == ["4", "\\frac12"]
    with pytest.raises(ValueError, match="no usable examples"):
        load_examples(path)  # keys match neither GSM8K nor MATH
    with pytest.raises(ValueError, match="unknown layout"):
        load_examples(path, layout="csv")


def test_auto_layout_reads_one_overridden_key_as_that_layouts_own_name(tmp_path):
    """layout auto with prompt_key alone: rows of `input` + a GSM8K answer were all skipped ("cannot
    detect the layout"), though every layout honours the key overrides."""
    gsm = write_jsonl(tmp_path / "gsm.jsonl", [{"input": "What is 2 + 3?", "answer": "Add them.\n#### 5"}])
    assert [(e.prompt, e.answer) for e in load_examples(gsm, prompt_key="input")] == [("What is 2 + 3?", "5")]
    math = write_jsonl(tmp_path / "math.jsonl", [{"problem": "Half of 1?", "sol": "It is \\boxed{\\frac12}."}])
    assert [e.answer for e in load_examples(math, answer_key="sol")] == ["\\frac12"]


def test_malformed_rows_are_skipped_and_counted(tmp_path, caplog):
    rows = [
        GSM8K_ROWS[0],
        '{"question": "broken json", "answer": ',  # line 2: invalid JSON
        {"question": "no answer here"},  # line 3: missing key
        {"question": "   ", "answer": "#### 3"},  # line 4: empty prompt
        "",  # blank lines are ignored, not errors
        GSM8K_ROWS[1],
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="qerl.data"):
        ex = load_examples(path)
    assert [e.answer for e in ex] == ["72", "1080"]
    assert ex.num_skipped == 3 and ex.num_rows == 5
    assert [e.index for e in ex] == [0, 4]
    text = caplog.text
    # the truncated row's error is at its own end (column 39: past its 38 characters and the space
    # written after them), not at "column 1" of the line after it
    assert f"{path}:2" in text and "invalid JSON (Expecting value at column 39)" in text
    assert f"{path}:3" in text and "missing field 'answer'" in text
    assert f"{path}:4" in text
    assert "skipped 3 malformed of 5 rows" in text


def test_a_line_of_broken_utf8_is_one_bad_row(tmp_path, caplog):
    good = [json.dumps(GSM8K_ROWS[0]).encode(), json.dumps(GSM8K_ROWS[1]).encode()]
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + good[0] + b'\n{"question": "caf\xe9 \xff", "answer": "#### 1"}\r\n' + good[1] + b"\n")
    with caplog.at_level(logging.WARNING, logger="qerl.data"):
        ex = load_examples(path)
    assert [e.answer for e in ex] == ["72", "1080"] and ex.num_skipped == 1
    assert f"{path}:2" in caplog.text and "invalid UTF-8 (byte 0xe9 at column 18)" in caplog.text
    old_mac = tmp_path / "cr.jsonl"  # CR-only line ends (read as lines, as text mode always did)
    old_mac.write_bytes(good[0] + b"\r" + good[1] + b"\r")
    assert [e.answer for e in load_examples(old_mac)] == ["72", "1080"]


def test_all_rows_bad_is_a_clear_error(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", ["not json", '{"question": "q"}'])
    with pytest.raises(ValueError, match="no usable examples.*first error"):
        load_examples(path, layout="gsm8k")


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "train.jsonl"
    with pytest.raises(FileNotFoundError, match="nope/train.jsonl"):
        load_examples(str(missing))


def test_limit_keeps_first_usable_rows(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    assert [e.answer for e in load_examples(path, limit=2)] == ["72", "1080"]


def test_json_and_parquet_and_directory_sources(tmp_path):
    datasets = pytest.importorskip("datasets")
    (tmp_path / "rows.json").write_text(json.dumps(MATH_ROWS))
    assert [e.answer for e in load_examples(str(tmp_path / "rows.json"))][1] == "\\frac{1}{2}"

    ds = datasets.Dataset.from_list(GSM8K_ROWS)
    ds.to_parquet(str(tmp_path / "gsm8k.parquet"))
    assert [e.answer for e in load_examples(str(tmp_path / "gsm8k.parquet"))] == ["72", "1080", "-3"]

    # <dir>/<split>.jsonl
    split_dir = tmp_path / "split_dir"
    split_dir.mkdir()
    write_jsonl(split_dir / "test.jsonl", GSM8K_ROWS[:2])
    write_jsonl(split_dir / "train.jsonl", GSM8K_ROWS)
    assert len(load_examples(str(split_dir), split="test")) == 2
    assert len(load_examples(str(split_dir), split="train")) == 3

    # Dataset.save_to_disk folder (DatasetDict → split is picked)
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": ds, "test": datasets.Dataset.from_list(MATH_ROWS)}).save_to_disk(str(saved))
    assert [e.answer for e in load_examples(str(saved), split="test")][1] == "\\frac{1}{2}"

    # A Hub-style repo folder (data/<split>-*.parquet) goes through datasets.load_dataset, offline.
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    ds.to_parquet(str(repo / "data" / "train-00000-of-00001.parquet"))
    assert [e.answer for e in load_examples(str(repo), split="train")] == ["72", "1080", "-3"]

    # A downloaded multi-config repo (openai/gsm8k: main/, socratic/): `<dir>:<config>`.
    multi = tmp_path / "gsm8k_repo"
    for config, rows in (("main", GSM8K_ROWS), ("socratic", GSM8K_ROWS[:1])):
        (multi / config).mkdir(parents=True)
        datasets.Dataset.from_list(rows).to_parquet(str(multi / config / "train-00000-of-00001.parquet"))
    (multi / "README.md").write_text("---\nconfigs:\n" + "".join(
        f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train-*\n" for c in ("main", "socratic"))
        + "---\n")
    assert [e.answer for e in load_examples(f"{multi}:main", split="train")] == ["72", "1080", "-3"]
    assert len(load_examples(f"{multi}:socratic", split="train")) == 1


def test_non_text_fields_are_bad_rows(tmp_path, caplog):
    rows = [{"question": "Q1", "answer": True}, {"question": ["Q2"], "answer": "#### 5"},
            {"problem": "P", "answer": {"x": 1}}, {"question": "Q3", "answer": 7}, GSM8K_ROWS[0]]
    ex = load_examples(write_jsonl(tmp_path / "g.jsonl", rows[:2] + rows[3:]), layout="gsm8k")
    assert [e.answer for e in ex] == ["7", "72"] and ex.num_skipped == 2
    assert "field 'answer' is a bool" in caplog.text and "prompt field 'question' is not text (list" in caplog.text
    math = load_examples(write_jsonl(tmp_path / "m.jsonl", [rows[2], MATH_ROWS[0]]), layout="math")
    assert len(math) == 1 and "field 'answer' is a dict" in caplog.text


def test_hub_id_with_config(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kw):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(GSM8K_ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ex = load_examples("openai/gsm8k:main", split="test")
    assert calls == [("openai/gsm8k", "main", "test")]
    assert [e.answer for e in ex] == ["72", "1080", "-3"] and ex[0].source == "openai/gsm8k:main"
    load_examples("HuggingFaceH4/MATH-500", split="test", layout="gsm8k")
    assert calls[-1] == ("HuggingFaceH4/MATH-500", None, "test")


def test_unreachable_source_names_both_readings(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*a, **kw):
        raise ConnectionError("Couldn't reach 'nowhere/gsm8k' on the Hub (LocalEntryNotFoundError)\nmore lines")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(FileNotFoundError, match=r"'nowhere/gsm8k': no such local file or directory, and loading it as "
                                                 r"a Hugging Face dataset failed \(ConnectionError: Couldn't reach"):
        load_examples("nowhere/gsm8k", split="test")


def test_gsm8k_answer_without_marker_is_a_bad_row_unless_short(tmp_path, caplog):
    rows = [{"question": "Q1", "answer": "step one\nstep two, no marker"}, {"question": "Q2", "answer": "42"},
            {"question": "Q3", "answer": "x" * 100}, GSM8K_ROWS[0]]
    ex = load_examples(write_jsonl(tmp_path / "g.jsonl", rows), layout="gsm8k")
    assert [e.answer for e in ex] == ["42", "72"] and ex.num_skipped == 2
    assert "no '#### <final answer>' line" in caplog.text


def test_synthetic_is_deterministic_by_seed():
    a, b, c = synthetic_arithmetic(50, seed=1), synthetic_arithmetic(50, seed=1), synthetic_arithmetic(50, seed=2)
    assert a == b and a != c
    for ex in a:
        assert ex.prompt.startswith("What is ") and ex.prompt.endswith("?")
        assert ex.answer == str(eval(ex.prompt[len("What is ") : -1]))  # noqa: S307 (our own strings)
    operands = [int(t) for ex in synthetic_arithmetic(200, seed=0, max_operand=5) for t in ex.prompt[8:-1].split()[::2]]
    assert max(operands) == 5 and min(operands) == 0
    # The synthetic *source*: train and test differ, each is stable.
    assert load_examples("synthetic-arithmetic", limit=10) == load_examples("synthetic-arithmetic", limit=10)
    assert load_examples("synthetic-arithmetic", limit=10) != load_examples("synthetic-arithmetic", "test", limit=10)
    assert len(load_examples("synthetic-arithmetic")) == qdata.SYNTHETIC_DEFAULT_SIZE
    # held out: no validation or test problem is one of the train set's
    train = {e.prompt for e in load_examples("synthetic-arithmetic")}
    for split in ("validation", "test"):
        held_out = load_examples("synthetic-arithmetic", split)
        assert len(held_out) == qdata.SYNTHETIC_DEFAULT_SIZE and not train & {e.prompt for e in held_out}


# ------------------------------------------------------------------------------------------ prompts


def test_build_prompt_ids_uses_chat_template(tokenizer):
    ids = build_prompt_ids(tokenizer, "What is 1 + 1?", DEFAULT_SYSTEM_PROMPT)
    assert isinstance(ids, list) and all(type(t) is int for t in ids)
    text = tokenizer.decode(ids)
    assert text == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    )
    no_system = tokenizer.decode(build_prompt_ids(tokenizer, "Q?", None))
    assert no_system == "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"
    assert "\\boxed{}" in DEFAULT_SYSTEM_PROMPT


_GEMMA_LIKE_TEMPLATE = (  # Gemma's and Mistral-Instruct v0.1's templates raise on a system message
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}<turn>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<turn>model\n{% endif %}")


@pytest.mark.parametrize("template, flag, warning, expected", [
    (None, "_warned_no_template", "no chat template", "S\n\nQ?\n"),  # plain text
    (_GEMMA_LIKE_TEMPLATE, "_warned_folded_system_prompt", "refuses a system message",
     "<turn>user\nS\n\nQ?\n<turn>model\n"),  # the system prompt opens the user turn
])
def test_prompts_without_a_usable_system_turn_warn_once(template, flag, warning, expected, caplog, monkeypatch):
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = template
    monkeypatch.setattr(qprompts, flag, False)
    with caplog.at_level(logging.WARNING, logger="qerl.prompts"):
        first = build_prompt_ids(tokenizer, "Q?", "S")
        build_prompt_ids(tokenizer, "Q2?", "S")
    assert tokenizer.decode(first) == expected
    assert caplog.text.count(warning) == 1
    if template is not None:
        assert tokenizer.decode(build_prompt_ids(tokenizer, "Q?", None)) == "<turn>user\nQ?\n<turn>model\n"


R1_ZERO_TEMPLATE = ("A conversation between User and Assistant. {system_prompt}\nUser: {question}\n"
                    "Assistant: <think>")


def test_prompt_template_replaces_the_chat_template(tokenizer, caplog, monkeypatch):
    """A plain-text template: {question} / {system_prompt} filled in one pass, LaTeX braces and a
    question's own "{system_prompt}" left alone, no chat-template token anywhere."""
    question = r"Find {x} with \frac{1}{2} = x {system_prompt}"
    ids = build_prompt_ids(tokenizer, question, "Box it: \\boxed{}.", template=R1_ZERO_TEMPLATE)
    assert tokenizer.decode(ids) == (
        "A conversation between User and Assistant. Box it: \\boxed{}.\n"
        r"User: Find {x} with \frac{1}{2} = x {system_prompt}" "\nAssistant: <think>")
    # a template without {system_prompt}: the system prompt is left out, and that is said once
    monkeypatch.setattr(qprompts, "_warned_unused_system_prompt", False)
    with caplog.at_level(logging.WARNING, logger="qerl.prompts"):
        assert tokenizer.decode(build_prompt_ids(tokenizer, "Q?", "S", template="Q: {question}\nA:")) == "Q: Q?\nA:"
        build_prompt_ids(tokenizer, "Q2?", "S", template="Q: {question}\nA:")
        build_prompt_ids(tokenizer, "Q3?", None, template="Q: {question}\nA:")
    assert caplog.text.count("data.prompt_template has no {system_prompt}") == 1


def test_chat_template_kwargs_reach_the_template():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = (  # Qwen3-like: a variable that switches thinking off
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    plain = tokenizer.decode(build_prompt_ids(tokenizer, "Q?", None))
    off = tokenizer.decode(build_prompt_ids(tokenizer, "Q?", None, chat_template_kwargs={"enable_thinking": False}))
    assert plain == "<|user|>Q?<|assistant|>" and off == "<|user|>Q?<|assistant|><think></think>"


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt_template": "Solve: {problem}"}, "data.prompt_template must be text containing {question}"),
    ({"prompt_template": "{question}", "chat_template_kwargs": {"enable_thinking": False}}, "set one of them"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "cannot set add_generation_prompt"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "data.chat_template_kwargs must map names to values"),
])
def test_prompt_format_errors_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("}", r"\}")):
        PromptDataModule(**kwargs)


def test_datamodule_prompt_template_in_training_and_eval_batches_and_resume(tmp_path, tokenizer, caplog):
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)
    dm = make_dm(tokenizer, prompt_template=R1_ZERO_TEMPLATE, val_sources={"g": path})
    (batch,) = take(dm, 1)
    for ids, prompt in zip(batch["prompt_ids"], batch["prompts"]):
        assert tokenizer.decode(ids) == R1_ZERO_TEMPLATE.format(question=prompt, system_prompt=DEFAULT_SYSTEM_PROMPT)
    (val,) = dm.val_dataloader()
    first = next(iter(val))
    assert tokenizer.decode(first["prompt_ids"][0]).startswith("A conversation between User and Assistant.")
    # a resume under another prompt format is warned, like another source
    resumed = make_dm(tokenizer)
    resumed.load_state_dict(dm.state_dict())
    with caplog.at_level("WARNING", logger="lightning_modules.data"):
        next(iter(resumed.train_dataloader()))
    assert "'prompt_format': (" in caplog.text


# ------------------------------------------------------------------------------------------ DataModule


def make_dm(tokenizer, **kw):
    kw.setdefault("prompts_per_step", 4)
    kw.setdefault("num_train_examples", 30)
    dm = PromptDataModule(**kw)
    dm.set_tokenizer(tokenizer)
    dm.setup("fit")
    return dm


def take(dm, n):
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(n)]


def test_batch_format(tokenizer):
    (batch,) = take(make_dm(tokenizer), 1)
    assert isinstance(batch, dict) and set(batch) == set(BATCH_KEYS)
    assert all(isinstance(batch[k], list) and len(batch[k]) == 4 for k in BATCH_KEYS)
    for ids, prompt in zip(batch["prompt_ids"], batch["prompts"]):
        assert ids == build_prompt_ids(tokenizer, prompt, DEFAULT_SYSTEM_PROMPT)
    assert batch["sources"] == ["synthetic-arithmetic"] * 4


def test_seeded_order_is_reproducible_and_cycles_epochs(tokenizer):
    a = [b["indices"] for b in take(make_dm(tokenizer, seed=3), 20)]
    b = [b["indices"] for b in take(make_dm(tokenizer, seed=3), 20)]
    c = [b["indices"] for b in take(make_dm(tokenizer, seed=4), 20)]
    assert a == b and a != c
    # 30 prompts, 4 per batch → 7 batches (28 distinct prompts) per epoch, then a new permutation.
    epoch0 = sum(a[:7], [])
    assert len(set(epoch0)) == 28
    assert sum(a[7:14], []) != epoch0
    assert sum(a[7:14], []) == epoch_permutation(30, 3, 1)[:28].tolist()


def test_length_filter_drops_long_training_prompts_but_no_benchmark_problem(tmp_path, tokenizer, caplog):
    """max_prompt_length filters training prompts; a val/test set keeps every problem (a score over a
    subset is not the benchmark's) unless max_eval_prompt_length says otherwise."""
    rows = [{"question": "Short?", "answer": "#### 1"}, {"question": "Long " * 100 + "?", "answer": "#### 2"}] * 4
    path = write_jsonl(tmp_path / "g.jsonl", rows)
    short_len = len(build_prompt_ids(tokenizer, "Short?", DEFAULT_SYSTEM_PROMPT))
    long_len = len(build_prompt_ids(tokenizer, "Long " * 100 + "?", DEFAULT_SYSTEM_PROMPT))
    with caplog.at_level(logging.WARNING, logger="lightning_modules.data"):
        dm = make_dm(
            tokenizer, train_source=path, val_sources={"g": path}, max_prompt_length=short_len + 10,
            num_train_examples=None, prompts_per_step=2,
        )
        batches = take(dm, 4)
        val = dm.val_dataloader()
    assert {p for b in batches for p in b["prompts"]} == {"Short?"}
    assert sum(len(b["prompts"]) for b in val[0]) == 8
    assert "train set 'train': dropped 4 of 8 prompts longer than data.max_prompt_length" in caplog.text
    assert "val set" not in caplog.text
    assert dm.longest_prompt("eval") == long_len and dm.longest_prompt("train") == short_len
    capped = make_dm(tokenizer, train_source=path, val_sources={"g": path}, num_train_examples=None,
                     max_eval_prompt_length=short_len + 10)
    assert sum(len(b["prompts"]) for b in capped.val_dataloader()[0]) == 4
    assert "val set 'g': dropped 4 of 8 prompts longer than data.max_eval_prompt_length" in caplog.text


def test_refill_prompts_are_seeded_and_differ_between_ranks(tokenizer, monkeypatch):
    """DAPO's refill draws (``draw_extra``): the same seed gives the same prompts; under DDP each rank
    refills with its own prompts, disjoint from the other ranks' while the data allows."""
    dm = make_dm(tokenizer, seed=3)
    one = dm.draw_extra(5, seed=101)
    assert one == dm.draw_extra(5, seed=101) and one != dm.draw_extra(5, seed=102)
    per_rank = []
    for rank in (0, 1):
        monkeypatch.setattr(PromptDataModule, "_rank_world", lambda self, r=rank: (r, 2))
        per_rank.append(dm.draw_extra(5, seed=101))
    assert per_rank[1] == dm.draw_extra(5, seed=101)  # still seeded (resume draws the same)
    assert len(per_rank[1]["prompts"]) == 5 and not set(per_rank[0]["prompts"]) & set(per_rank[1]["prompts"])
    # more ranks than the data covers: every rank still gets its count, overlaps allowed
    monkeypatch.setattr(PromptDataModule, "_rank_world", lambda self: (3, 4))
    assert len(dm.draw_extra(10, seed=101)["prompts"]) == 10


def test_refill_prompts_pass_over_the_steps_own(tokenizer):
    """A refill drew from the whole set, so a prompt of the step's batch (or of an earlier refill)
    could be trained twice in one step; now those are passed over while the data allows."""
    dm = make_dm(tokenizer, seed=3)  # 30 prompts
    batch = take(dm, 1)[0]
    in_step = set(zip(batch["sources"], batch["indices"]))
    keys = lambda b: set(zip(b["sources"], b["indices"]))  # noqa: E731
    for seed in range(20):
        assert not keys(dm.draw_extra(8, seed=seed, exclude=in_step)) & in_step
    almost_all = keys(dm.draw_extra(28, seed=0))
    crowded = dm.draw_extra(4, seed=1, exclude=almost_all)  # 2 fresh prompts left: those, then 2 others
    assert len(keys(crowded)) == 4 and len(keys(crowded) - almost_all) == 2


def test_resume_yields_next_unseen_batch(tokenizer):
    original = take(make_dm(tokenizer, seed=7), 12)
    dm = make_dm(tokenizer, seed=7)
    take(dm, 3)
    state = dm.state_dict()
    assert state["batches_consumed"] == 3 and (state["epoch"], state["batch_in_epoch"]) == (0, 3)

    resumed = make_dm(tokenizer, seed=7)
    resumed.load_state_dict(state)
    it = iter(resumed.train_dataloader())
    assert next(it)["indices"] == original[3]["indices"]
    # ...and keeps going across the epoch boundary (7 batches per epoch).
    assert [next(it)["indices"] for _ in range(8)] == [b["indices"] for b in original[4:12]]
    assert resumed.state_dict()["epoch"] == 1 and resumed.state_dict()["batches_consumed"] == 12


@pytest.mark.parametrize("new_size", [8, 2, 3])
def test_resume_with_another_prompts_per_step_neither_skips_a_batch_nor_repeats(tokenizer, new_size):
    """The position counts batches of the checkpoint's size: 3 batches of 4 prompts read as batch 3
    of 8 started at prompt 24 (12 skipped), of 2 at prompt 6 (6 repeated). Now it continues at the
    first batch boundary at or after prompt 12 of the epoch's order."""
    dm = make_dm(tokenizer, seed=7)
    seen = [i for batch in take(dm, 3) for i in batch["indices"]]  # 12 prompts of epoch 0
    resumed = make_dm(tokenizer, seed=7, prompts_per_step=new_size)
    resumed.load_state_dict(dm.state_dict())
    order = [i for batch in take(make_dm(tokenizer, seed=7, prompts_per_step=1), 30) for i in batch["indices"]]
    first = next(iter(resumed.train_dataloader()))["indices"]
    start = -(-12 // new_size) * new_size  # 12 when it divides, else the next boundary (15 for 3)
    assert first == order[start:start + new_size] and not set(first) & set(seen)


def test_resume_on_another_train_source_names_it(tokenizer, caplog):
    dm = make_dm(tokenizer, seed=7)
    take(dm, 1)
    state = {**dm.state_dict(), "train_source": "data/gsm8k/train.jsonl"}
    resumed = make_dm(tokenizer, seed=7)
    resumed.load_state_dict(state)
    with caplog.at_level("WARNING", logger="lightning_modules.data"):
        next(iter(resumed.train_dataloader()))
    assert "'train_source': ('data/gsm8k/train.jsonl'" in caplog.text


def test_val_and_test_loaders_are_named_and_ordered(tmp_path, tokenizer):
    g = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    m = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    dm = PromptDataModule(
        val_sources={"math500": m, "gsm8k": g}, test_sources={"gsm8k": g}, val_prompts_per_batch=2,
        num_val_examples=2,
    )
    dm.set_tokenizer(tokenizer)
    dm.setup("fit")
    dm.setup("test")
    assert dm.val_names == ["math500", "gsm8k"] and dm.test_names == ["gsm8k"]
    val = dm.val_dataloader()
    assert [b["answers"] for b in val[0]] == [["\\left( 3, \\frac{\\pi}{2} \\right)", "\\frac{1}{2}"]]
    assert [b["answers"] for b in val[1]] == [["72", "1080"]]
    assert [b["indices"] for b in dm.test_dataloader()[0]] == [[0, 1]]
    assert PromptDataModule().val_dataloader() == []


def test_train_layout_keys_do_not_apply_to_eval_sets(tmp_path, tokenizer):
    rows = [{"prompt": f"What is {i} + 1?", "solution": str(i + 1)} for i in range(4)]
    train = write_jsonl(tmp_path / "bigmath.jsonl", rows)
    eval_dir = tmp_path / "gsm8k"
    eval_dir.mkdir()
    write_jsonl(eval_dir / "validation.jsonl", GSM8K_ROWS)
    dm = make_dm(
        tokenizer, train_source=train, layout="custom", prompt_key="prompt", answer_key="solution",
        val_sources={"gsm8k": str(eval_dir)}, eval_split="validation", prompts_per_step=2,
    )
    assert sorted(a for b in take(dm, 2) for a in b["answers"]) == ["1", "2", "3", "4"]
    assert [a for b in dm.val_dataloader()[0] for a in b["answers"]] == ["72", "1080", "-3"]


def test_missing_tokenizer_is_a_clear_error():
    dm = PromptDataModule(num_train_examples=8)
    dm.setup("fit")
    with pytest.raises(RuntimeError, match="set_tokenizer"):
        dm.train_dataloader()
    dm = PromptDataModule(num_train_examples=8, tokenizer_name_or_path="tiny-qwen2", prompts_per_step=2)
    dm.setup("fit")
    assert len(take(dm, 1)[0]["prompt_ids"]) == 2


# ------------------------------------------------------------------------------------------ Trainer


def _trainer_run(tmp_path, tokenizer, max_steps, ckpt_path=None, module_transfer_hook=False):
    import lightning as L

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.tokenizer = tokenizer  # found by PromptDataModule.setup
            self.seen = []
            self.val_seen = []

        def training_step(self, batch, batch_idx):
            assert set(batch) == set(BATCH_KEYS)
            self.seen.append(batch["indices"])
            return (self.w - 1).pow(2).sum()

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.val_seen.append((self.trainer.datamodule.val_names[dataloader_idx], batch["answers"]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    tmp_path.mkdir(parents=True, exist_ok=True)
    val = write_jsonl(tmp_path / "val.jsonl", GSM8K_ROWS)
    dm = PromptDataModule(val_sources={"gsm8k": val}, num_train_examples=30, prompts_per_step=4, seed=5)
    class RecorderWithHook(Recorder):
        def on_before_batch_transfer(self, batch, dataloader_idx):  # Lightning calls the DataModule's instead
            return batch

    module = RecorderWithHook() if module_transfer_hook else Recorder()
    trainer = L.Trainer(
        max_steps=max_steps, val_check_interval=4, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), enable_checkpointing=False,
    )
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return trainer, module, dm


def test_a_module_transfer_hook_does_not_change_the_count(tmp_path, tokenizer):
    _, module, dm = _trainer_run(tmp_path, tokenizer, max_steps=5, module_transfer_hook=True)
    assert len(module.seen) == 5 and dm.state_dict()["batches_consumed"] == 5  # not 11 (counted twice)


def test_trainer_resume_continues_the_stream(tmp_path, tokenizer):
    _, full, _ = _trainer_run(tmp_path / "full", tokenizer, max_steps=9)
    assert len(full.seen) == 9
    assert full.val_seen and full.val_seen[0] == ("gsm8k", ["72", "1080", "-3"])

    trainer, first, dm = _trainer_run(tmp_path / "a", tokenizer, max_steps=5)
    # Lightning prefetches one batch; the position must count only the 5 trained batches.
    assert dm.state_dict()["batches_consumed"] == 5
    ckpt = str(tmp_path / "a" / "step5.ckpt")
    trainer.save_checkpoint(ckpt)
    _, second, _ = _trainer_run(tmp_path / "b", tokenizer, max_steps=9, ckpt_path=ckpt)
    assert first.seen + second.seen == full.seen


@pytest.mark.parametrize("value,text", [
    (5e-05, "0.00005"),  # not "5e-05": math-verify reads that as e - 5
    (27.0, "27"), (-0.5, "-0.5"), (1e20, "100000000000000000000"),
    (float(torch.tensor(123.45, dtype=torch.float32)), "123.45"),  # a float32 parquet column
    (0.1, "0.1"), (1e23, "100000000000000000000000"),  # (str(int(1e23)): the binary float's digits)
    (-0.0, "0"),
])
def test_numeric_answers_are_written_as_people_write_them(value, text):
    assert qdata._as_text(value) == text


def test_json_nested_deeper_than_python_parses_is_one_bad_row(tmp_path, caplog):
    """json.loads raised RecursionError (not a JSONDecodeError): the whole load ended in a traceback."""
    deep = '{"question": "q2", "answer": "#### 2", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path = write_jsonl(tmp_path / "deep.jsonl", [GSM8K_ROWS[0], deep, GSM8K_ROWS[1]])
    with caplog.at_level(logging.WARNING, logger="qerl.data"):
        loaded = load_examples(path)
    assert len(loaded) == 2 and loaded.num_skipped == 1
    assert f"{path}:2: invalid JSON (nested too deeply" in caplog.text
    as_json = tmp_path / "deep.json"
    as_json.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="nested too deeply"):
        load_examples(str(as_json))


def test_a_nan_answer_is_an_empty_field(tmp_path, caplog):
    """A NaN (pandas' missing value, JSON's ``NaN``) is no gold: the row is skipped, not graded against 'nan'."""
    path = write_jsonl(tmp_path / "nan.jsonl", ['{"problem": "p1", "answer": NaN}', '{"problem": "p2", "answer": 3}',
                                                '{"question": "q3", "answer": NaN}'])
    with caplog.at_level(logging.WARNING, logger="qerl.data"):
        ex = load_examples(path, layout="math")
    assert [e.answer for e in ex] == ["3"] and ex.num_skipped == 2
    assert f"{path}:1: field 'answer' is NaN (a missing value), not an answer" in caplog.text
    assert load_examples(path, layout="gsm8k", prompt_key="problem").num_skipped == 2  # `_field`: empty


def test_a_lone_surrogate_is_a_bad_row(tmp_path, tokenizer, caplog):
    """Half an emoji (JSON ``"\ud83d"``) loads as a lone surrogate that the fast tokenizer later rejects
    with a TypeError; it is a malformed row, named and counted, and the rest encode."""
    rows = ['{"question": "Emoji cut in half: \\ud83d", "answer": "#### 6"}',
            '{"question": "A whole one \\ud83d\\ude00", "answer": "#### 7"}', GSM8K_ROWS[0]]
    path = write_jsonl(tmp_path / "surrogate.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="qerl.data"):
        ex = load_examples(path)
    assert [e.answer for e in ex] == ["7", "72"] and ex.num_skipped == 1
    assert f"{path}:1: field 'question' is not valid Unicode (lone surrogate '\\ud83d' at character 20)" in caplog.text
    assert len(qdata.encode_prompts(tokenizer, ex, DEFAULT_SYSTEM_PROMPT)[1]) == 2


def test_json_files_broken_encoding_lines_and_single_rows(tmp_path, caplog):
    """``.json``: invalid UTF-8 names the file; JSON Lines saved as ``.json`` is read line by line even
    when a line is broken; one object is one row unless it holds the list of rows."""
    lines = [json.dumps(r).encode() for r in GSM8K_ROWS]
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'[{"question": "caf\xe9", "answer": "#### 1"}]')
    with pytest.raises(ValueError, match=f"^{latin}: invalid UTF-8 \\(byte 0xe9 at line 1, column 19\\)"):
        load_examples(str(latin))
    latin_lines = tmp_path / "latin_lines.json"
    latin_lines.write_bytes(b"\n".join([lines[0], b'{"question": "caf\xe9", "answer": "#### 1"}', lines[1]]))
    truncated = tmp_path / "trunc_first.json"
    truncated.write_bytes(b"\n".join([lines[0][:-1], lines[1], lines[2]]))
    with caplog.at_level(logging.WARNING, logger="qerl.data"):
        assert [e.answer for e in load_examples(str(latin_lines))] == ["72", "1080"]
        assert [e.answer for e in load_examples(str(truncated))] == ["1080", "-3"]
    assert f"{latin_lines}:2: invalid UTF-8" in caplog.text and f"{truncated}:1: invalid JSON" in caplog.text
    single = tmp_path / "single.json"
    single.write_text(json.dumps(GSM8K_ROWS[2]) + "\n")
    assert [e.answer for e in load_examples(str(single))] == ["-3"]
    wrapped = tmp_path / "wrapped.json"  # a row list beside metadata, and a row with a list field
    wrapped.write_text(json.dumps({"version": "1", "data": GSM8K_ROWS[:2]}))
    assert [e.answer for e in load_examples(str(wrapped))] == ["72", "1080"]
    single.write_text(json.dumps({**GSM8K_ROWS[2], "tags": ["a", "b"]}))
    assert [e.answer for e in load_examples(str(single))] == ["-3"]
    for extra in ({"tags": []}, {"hints": [{"text": "add"}]}):  # empty lists / lists of objects in a row
        single.write_text(json.dumps({**GSM8K_ROWS[2], **extra}))
        assert [e.answer for e in load_examples(str(single))] == ["-3"], extra
    wrapped.write_text(json.dumps({"data": GSM8K_ROWS[:2], "errors": []}))  # an empty list beside the rows
    assert [e.answer for e in load_examples(str(wrapped))] == ["72", "1080"]
    pretty = tmp_path / "pretty.json"  # a broken pretty-printed document keeps its own error
    pretty.write_text(json.dumps(GSM8K_ROWS, indent=2)[:-1])
    with pytest.raises(ValueError, match=f"{pretty}: not valid JSON"):
        load_examples(str(pretty))


def test_a_byte_order_mark_inside_joined_files_is_dropped(tmp_path):
    """Files saved with a BOM and joined with ``cat`` carry it at the start of a later line."""
    path = tmp_path / "cat.jsonl"
    path.write_text("".join("\ufeff" + json.dumps(r) + "\n" for r in GSM8K_ROWS[:2]), encoding="utf-8")
    ex = load_examples(str(path))
    assert [e.answer for e in ex] == ["72", "1080"] and ex.num_skipped == 0


def test_short_answer_sets_and_byte_order_marks_load(tmp_path):
    """AMC / AIME style rows (``question`` + a short, often numeric ``answer``) auto-detect; a file
    saved with a UTF-8 byte-order mark keeps its first row."""
    rows = [{"question": "How many?", "answer": 27.0, "id": 1}, {"question": "Which?", "answer": "\\frac{1}{2}"}]
    path = tmp_path / "amc.jsonl"
    path.write_text("\ufeff" + "\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    examples = load_examples(str(path), "test")
    assert [(e.prompt, e.answer) for e in examples] == [("How many?", "27"), ("Which?", "\\frac{1}{2}")]
    as_json = tmp_path / "amc.json"
    as_json.write_text("\ufeff" + json.dumps(rows), encoding="utf-8")
    assert len(load_examples(str(as_json), "test")) == 2



@pytest.mark.parametrize("key", ["num_train_examples", "num_val_examples"])
def test_a_non_positive_example_limit_names_its_key(key):
    with pytest.raises(ValueError, match=f"data.{key} must be >= 1 or null"):
        PromptDataModule(**{key: 0})


@pytest.mark.parametrize("value", ["1e400", "-1e400", "Infinity", "NaN"])
def test_a_non_finite_numeric_answer_is_skipped_with_its_own_reason(tmp_path, caplog, value):
    """JSON's ``1e400`` loads as inf: no gold "inf" (nothing a model writes matches it); a NaN is a
    missing value, not an empty field. Each is skipped, named by its line, in every layout; a MATH
    row's NaN answer beside a solution takes the solution's box (a parquet column's missing value)."""
    rows = ['{"question": "q1", "answer": %s}' % value, '{"question": "q2", "answer": "7"}']
    path = write_jsonl(tmp_path / "nonfinite.jsonl", rows)
    reason = "is NaN (a missing value)" if value == "NaN" else "is a non-finite number"
    for kw in (dict(), dict(layout="gsm8k"), dict(layout="custom", prompt_key="question", answer_key="answer"),
               dict(layout="math", prompt_key="question")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="qerl.data"):
            ex = load_examples(path, **kw)
        assert [e.answer for e in ex] == ["7"] and ex.num_skipped == 1, kw
        assert f"{path}:1: field 'answer' {reason}" in caplog.text, (kw, caplog.text)
    with_solution = write_jsonl(tmp_path / "solution.jsonl", ['{"problem": "p", "answer": NaN, "solution": "so \\\\boxed{4}"}'])
    assert [e.answer for e in load_examples(with_solution, layout="math")] == ["4"]


@pytest.mark.parametrize("bad", [dict(val_prompts_per_batch=-2), dict(val_prompts_per_batch=0), dict(num_workers=-1),
                                 dict(prompts_per_step=0), dict(max_prompt_length=0), dict(max_eval_prompt_length=0),
                                 dict(num_train_examples=0), dict(num_val_examples=-1), dict(seed=-1),
                                 dict(prompts_per_step=2.5)],
                         ids=lambda bad: f"{next(iter(bad))}={next(iter(bad.values()))}")
def test_bad_data_counts_fail_at_construction_naming_their_key(bad):
    """Before the model loads (a negative val_prompts_per_batch failed at the first validation batch,
    with a message that did not name it)."""
    with pytest.raises(ValueError, match=f"^data.{next(iter(bad))} must be >= [01].*an integer; got "):
        PromptDataModule(**bad)
    with pytest.raises(ValueError, match="data.layout must be one of"):
        PromptDataModule(layout="gsm")
    for key in ("val_sources", "test_sources"):  # a set's name makes its tags: val//pass@1 had none
        with pytest.raises(ValueError, match=f"data.{key}: each set needs a name"):
            PromptDataModule(**{key: {"gsm8k": "synthetic-arithmetic", " ": "synthetic-arithmetic"}})
    PromptDataModule(val_prompts_per_batch=None, seed=None, num_workers=0, max_eval_prompt_length=None)  # defaults


def test_an_integer_answer_longer_than_int_converts_loads_as_its_digits(tmp_path):
    """json.loads raises on an integer of more than 4300 digits (Python's int-string limit), which
    ended the whole load; it is kept as its digits, a bare answer however long, and scores."""
    import sys

    from qerl.rewards import MathAccuracy

    big = "7" * (sys.get_int_max_str_digits() + 1)
    jsonl = write_jsonl(tmp_path / "big.jsonl", ['{"question": "q", "answer": %s}' % big, '{"question": "p", "answer": 3}'])
    whole = tmp_path / "big.json"
    whole.write_text('[{"question": "q", "answer": -%s}]' % big)
    assert [e.answer for e in load_examples(jsonl)] == [big, "3"]
    assert [e.answer for e in load_examples(str(whole))] == ["-" + big]
    assert MathAccuracy()(["\\boxed{%s}" % big], [big]) == [1.0]


def test_column_oriented_json_is_one_line_and_index_oriented_rows_load(tmp_path):
    """pandas' default `to_json` writes one object per column: it read as one row whose fields are
    dicts ("field 'answer' is a dict"); now a one-line error saying how to write rows. Its `index`
    layout ({"0": row, "1": row}) is rows and loads."""
    rows = [{"question": "What is 1+1?", "answer": "#### 2"}, {"question": "What is 2+2?", "answer": "#### 4"}]
    layouts = {
        "columns": {"question": {"0": rows[0]["question"], "1": rows[1]["question"]},
                    "answer": {"0": rows[0]["answer"], "1": rows[1]["answer"]}},
        "split": {"columns": ["question", "answer"], "index": [0, 1], "data": [[r["question"], r["answer"]] for r in rows]},
        "lists": {"question": [r["question"] for r in rows], "answer": [r["answer"] for r in rows]},
    }
    for name, data in layouts.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=r"column-oriented JSON .* orient='records', lines=True"):
            load_examples(str(path))
    path = tmp_path / "index.json"
    path.write_text(json.dumps({"0": rows[0], "1": rows[1]}))
    assert [(e.prompt, e.answer) for e in load_examples(str(path))] == [("What is 1+1?", "2"), ("What is 2+2?", "4")]


def test_a_prompt_that_is_not_text_is_a_skipped_row(tmp_path, caplog):
    path = tmp_path / "num.jsonl"
    path.write_text('{"question": 5, "answer": "#### 6"}\n{"question": "ok?", "answer": 6}\n')
    with caplog.at_level(logging.WARNING):
        examples = load_examples(str(path))
    assert [(e.prompt, e.answer) for e in examples] == [("ok?", "6")]  # a number is fine as an answer
    assert "prompt field 'question' is not text (int 5)" in caplog.text


def test_a_folder_of_data_files_reads_every_file_and_skips_bad_rows(tmp_path, caplog):
    """Files that name no split are one training set, each read by our readers: a malformed line is
    a skipped row (datasets failed the whole load on it) and mixed types all count (it read one)."""
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "mixed"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [GSM8K_ROWS[0], '{"question": "broken", "answer": "#### 2"'])
    datasets.Dataset.from_list(GSM8K_ROWS[1:]).to_parquet(str(folder / "b.parquet"))
    with caplog.at_level(logging.WARNING, logger="qerl.data"):
        loaded = load_examples(str(folder))
    assert [e.answer for e in loaded] == ["72", "1080", "-3"] and loaded.num_skipped == 1
    assert "a.jsonl:2" in caplog.text
    # rows numbered through the folder: (source, index) names one row (a DDP evaluation's merge keeps
    # one record per index; with each file from 0 it dropped half of them)
    assert [e.index for e in loaded] == [0, 2, 3]
    with pytest.raises(ValueError, match="mixed: no 'test' split .*one training set"):
        load_examples(str(folder), split="test")
    with pytest.raises(ValueError, match="mixed:main: .*'main'"):  # datasets' errors name the folder
        load_examples(f"{folder}:main")


def test_a_folder_whose_file_names_hold_a_split_word_keeps_its_splits(tmp_path):
    """`gsm8k_train.jsonl` + `gsm8k_test.jsonl`: datasets' split inference, not one training set
    (the test rows would have leaked into training)."""
    pytest.importorskip("datasets")
    folder = tmp_path / "named"
    folder.mkdir()
    write_jsonl(folder / "gsm8k_train.jsonl", GSM8K_ROWS)
    write_jsonl(folder / "gsm8k_test.jsonl", GSM8K_ROWS[:1])
    assert len(load_examples(str(folder), split="train")) == 3 and len(load_examples(str(folder), split="test")) == 1


def test_several_training_sources_are_shuffled_together(tmp_path, tokenizer):
    """A list of training sources: each loads with its own layout (GSM8K and MATH rows here),
    num_train_examples per source, one stream over all of them."""
    g = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    m = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    dm = make_dm(tokenizer, train_source=[g, m], num_train_examples=2, prompts_per_step=2)
    seen = [(p, a) for b in take(dm, 4) for p, a in zip(b["prompts"], b["answers"])]
    assert {a for _, a in seen} == {"72", "1080", "\\left( 3, \\frac{\\pi}{2} \\right)", "\\frac{1}{2}"}
    assert dm.state_dict()["train_source"] == str([g, m])
    for bad in ([], [g, None], [""]):
        with pytest.raises(ValueError, match="data.train_source must be a source or a non-empty list"):
            PromptDataModule(train_source=bad)
    assert dm.train_source_names == {g: "gsm8k", m: "math"}  # the tags of train/reward_by_source/<name>
    assert {s for b in take(dm, 2) for s in b["sources"]} <= {g, m}
    assert make_dm(tokenizer, train_source=g).train_source_names == {}  # one source: no per-source curves


def test_source_names_are_short_and_distinct():
    assert source_names(["data/gsm8k/train.jsonl", "data/math500/test.jsonl", "openai/gsm8k"]) == {
        "data/gsm8k/train.jsonl": "gsm8k_train", "data/math500/test.jsonl": "math500_test", "openai/gsm8k": "gsm8k"}
    # a clash keeps more of the path; what still clashes is numbered; a repeated source is one name
    assert source_names(["a/x/train.jsonl", "b/x/train.jsonl"]) == {"a/x/train.jsonl": "a_x_train",
                                                                    "b/x/train.jsonl": "b_x_train"}
    assert source_names(["gsm8k.jsonl", "gsm8k.parquet", "gsm8k.jsonl"]) == {"gsm8k.jsonl": "gsm8k",
                                                                             "gsm8k.parquet": "gsm8k_2"}
    assert source_names(["synthetic-arithmetic", "./d/"]) == {"synthetic-arithmetic": "synthetic-arithmetic", "./d/": "d"}
    # numbering never lands on a taken name, nor takes another source's own name
    assert source_names(["a.jsonl", "a.parquet", "a_2.jsonl"]) == {"a.jsonl": "a", "a.parquet": "a_3", "a_2.jsonl": "a_2"}
    assert source_names(["data/GSM8K/Train.JSONL", "x.jsonl"])["data/GSM8K/Train.JSONL"] == "GSM8K_Train"
