"""`PromptDataModule`: prompt batches for GRPO/DAPO training and per-benchmark validation.

A training batch is ``prompts_per_step`` prompts (each is later sampled G times by the rollout
engine); it is a dict of plain lists, never padded tensors (the rollout engine pads)::

    {"prompt_ids": list[list[int]], "prompts": list[str], "answers": list[str],
     "indices": list[int], "sources": list[str]}

The training stream is **infinite**: epoch ``e`` visits the prompts in a permutation fixed by
``(seed, e)`` (the last ``n % prompts_per_step`` prompts of a permutation are dropped, and come
back in later epochs), then the next epoch starts. ``trainer.max_steps`` therefore decides how
long training runs; set it, and validate by steps::

    trainer:
      max_steps: 500
      val_check_interval: 50         # an int: every 50 training batches
      check_val_every_n_epoch: null  # Lightning "epochs" never end on an infinite loader

Resuming: `state_dict` holds the data position (epoch, batch within the epoch, batches consumed)
and Lightning stores it in every checkpoint; ``fit(ckpt_path=...)`` restores it and the stream
continues with the first batch the interrupted run had not trained on. Under a Trainer a batch
counts as consumed when it reaches the training step (through this module's
`on_before_batch_transfer` hook; Lightning fetches one batch ahead, so counting at the loader
would skip one); iterated by hand (no trainer), it counts when the loader yields it.

Validation/test: each entry of ``val_sources`` / ``test_sources`` (name → source) is its own
dataloader, in order; ``val_names[dataloader_idx]`` names it. Batches hold no tensors, so log
with ``self.log(..., batch_size=len(batch["prompts"]))``.

The tokenizer normally comes from the model: the LightningModule calls
``trainer.datamodule.set_tokenizer(tokenizer)`` (e.g. in its ``setup``), or the data module
takes ``trainer.lightning_module.tokenizer`` itself. Prompts are tokenized lazily, when the
first dataloader is built, so either order works.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import lightning as L
import numpy as np
from torch.utils.data import DataLoader

from lightning_modules.data_position import DataPosition
from lightning_modules.prompt_stream import (  # noqa: F401  (BATCH_KEYS, epoch_permutation: re-exported)
    BATCH_KEYS,
    PromptBatch,
    PromptStream,
    _EvalCollate,
    _PromptStreamLoader,
    collate_examples,
    epoch_permutation,
)
from qerl.seeding import resolve_seed
from qerl.settings_checks import require_counts
from qerl.data import Layout, PromptExample, load_examples, source_names
from qerl.prompts import DEFAULT_SYSTEM_PROMPT, check_prompt_format, encode_prompts, prompt_format_digest

logger = logging.getLogger(__name__)

class PromptDataModule(L.LightningDataModule):
    """Math prompts for GRPO/DAPO: an infinite seeded training stream plus named eval sets.

    Args:
        train_source: Training prompts: a ``.jsonl``/``.json``/``.parquet`` file, a directory, a
            Hugging Face dataset id (``"openai/gsm8k:main"`` = id ``openai/gsm8k``, config
            ``main``; ``"<dir>:main"`` for a downloaded copy), or ``"synthetic-arithmetic"``
            (generated "What is 7 + 5?" problems). A list of sources trains on all of them, shuffled
            together (each its own layout when ``auto``; ``num_train_examples`` applies per source).
        val_sources: Validation sets, name → source (e.g. ``{"gsm8k": "data/gsm8k/test.jsonl",
            "math500": "data/math500/test.jsonl"}``); one dataloader each, in this order, named
            by ``val_names``. None: no validation.
        test_sources: Test sets for ``trainer.test``, like ``val_sources`` (names in ``test_names``).
        split: Split of ``train_source`` when it is a directory or dataset id.
        eval_split: Split of the val/test sources when they are directories or dataset ids.
        layout: Row layout of ``train_source``: ``auto`` (detect GSM8K ``question``/``answer``
            with ``####`` or MATH ``problem``/``answer``/``solution``), ``gsm8k``, ``math`` or
            ``custom``. Val/test sets are always auto-detected.
        prompt_key: Field holding the question in ``train_source`` (needed for ``custom``;
            overrides the layout default).
        answer_key: Field holding the gold answer in ``train_source`` (needed for ``custom``;
            overrides the layout default).
        system_prompt: System message before every question; None or "" for none (then the model's
            chat template decides: Qwen2.5's adds its own "You are Qwen, created by Alibaba Cloud..."
            prompt, which does not ask for ``\\boxed{}``).
        prompt_template: The whole prompt as plain text instead of the tokenizer's chat template,
            for base models and "Zero" recipes; ``{question}`` (required) and ``{system_prompt}``
            are filled in, nothing else is interpreted. E.g. R1-Zero's ``"A conversation between
            User and Assistant. ... User: {question} Assistant: <think>"``. None: the chat template.
        chat_template_kwargs: Extra variables for the tokenizer's chat template, e.g.
            ``{enable_thinking: false}`` for Qwen3's non-thinking mode.
        prompts_per_step: Prompts per training batch (per device); each is sampled G times later.
        max_prompt_length: Longest training prompt in tokens (chat template included); longer
            prompts are dropped, with a logged count.
        max_eval_prompt_length: The same for the val/test sets; null (default) keeps every problem,
            so a benchmark score is over the whole set (a limit logs how many it dropped).
        num_train_examples: Use only the first N usable training rows (None: all).
        num_val_examples: Use only the first N usable rows of each val/test set (None: all).
        val_prompts_per_batch: Prompts per validation/test batch (None: ``prompts_per_step``).
        seed: Seed of the training order (epoch ``e`` uses the permutation of ``(seed, e)``);
            null: the run's ``seed_everything``.
        num_workers: DataLoader worker processes (0: load in the main process).
        tokenizer_name_or_path: Tokenizer to load here (HF id or path; ``tiny-qwen2`` /
            ``tiny-llama`` for the built-in tiny one) when the data module is used on its own;
            refused beside a LightningModule that has a ``tokenizer`` (train.py's model brings its
            own). None: use the model's tokenizer, given by `set_tokenizer` or found as
            ``trainer.lightning_module.tokenizer``.
    """

    def __init__(
        self,
        train_source: str | list[str] = "synthetic-arithmetic",
        val_sources: dict[str, str] | None = None,
        test_sources: dict[str, str] | None = None,
        split: str = "train",
        eval_split: str = "test",
        layout: Layout = "auto",
        prompt_key: str | None = None,
        answer_key: str | None = None,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        prompt_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        prompts_per_step: int = 8,
        max_prompt_length: int = 512,
        max_eval_prompt_length: int | None = None,
        num_train_examples: int | None = None,
        num_val_examples: int | None = None,
        val_prompts_per_batch: int | None = None,
        seed: int | None = None,
        num_workers: int = 0,
        tokenizer_name_or_path: str | None = None,
    ):
        super().__init__()
        # every count is checked here, naming its key, not when the first dataloader is built (after
        # the model has loaded)
        require_counts("data", (
            ("prompts_per_step", prompts_per_step, 1, None),
            ("max_prompt_length", max_prompt_length, 1, None),
            ("max_eval_prompt_length", max_eval_prompt_length, 1, "no limit"),
            ("num_train_examples", num_train_examples, 1, "all rows"),
            ("num_val_examples", num_val_examples, 1, "all rows"),
            ("val_prompts_per_batch", val_prompts_per_batch, 1, "prompts_per_step"),
            ("seed", seed, 0, "seed_everything's"),
            ("num_workers", num_workers, 0, None),
        ))
        if not isinstance(train_source, str) and (
                not train_source or not all(isinstance(one, str) and one for one in train_source)):
            raise ValueError(f"data.train_source must be a source or a non-empty list of them, got {train_source!r}")
        for key, sets in (("val_sources", val_sources), ("test_sources", test_sources)):
            bad = [name for name in (sets or {}) if not isinstance(name, str) or not name.strip()]
            if bad:  # a set's name is part of its TensorBoard tags (val/<name>/pass@1) and a report's column
                raise ValueError(f"data.{key}: each set needs a name (val/<name>/pass@1), got {bad!r}")
        check_prompt_format(prompt_template, chat_template_kwargs)
        if layout not in typing.get_args(Layout):  # (the CLI checks it; a module built in code did not)
            raise ValueError(f"data.layout must be one of {', '.join(typing.get_args(Layout))}, got {layout!r}")
        # `seed` is also QeRLModule's argument (the tiny model's init): Lightning refuses to log two
        # different values under one name, so this one is kept as `data_seed`
        self.save_hyperparameters(ignore=["seed"])
        self.save_hyperparameters({**self.hparams, "data_seed": seed})
        self.train_source = train_source
        self.val_sources = dict(val_sources or {})
        self.test_sources = dict(test_sources or {})
        self.split = split
        self.eval_split = eval_split
        self.layout = layout
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.system_prompt = system_prompt
        self.prompt_template = prompt_template
        self.chat_template_kwargs = dict(chat_template_kwargs) if chat_template_kwargs is not None else None
        self.prompts_per_step = prompts_per_step
        self.max_prompt_length = max_prompt_length
        self.max_eval_prompt_length = max_eval_prompt_length
        self.num_train_examples = num_train_examples
        self.num_val_examples = num_val_examples
        self.val_prompts_per_batch = val_prompts_per_batch or prompts_per_step
        self.seed = resolve_seed(seed, "data.seed")
        self.num_workers = num_workers
        self.tokenizer_name_or_path = tokenizer_name_or_path

        self.tokenizer: Any = None
        # Raw examples per (kind, name) and their tokenized, length-filtered version.
        self._raw: dict[tuple[str, str], list[PromptExample]] = {}
        self._encoded: dict[tuple[str, str], tuple[list[PromptExample], list[list[int]]]] = {}
        self._left_out: dict[tuple[str, str], int] = {}  # rows not evaluated: malformed, or prompts over the limit
        # Data position: the next unseen training batch, and how many were consumed.
        self._position = DataPosition()
        self._stream: PromptStream | None = None

    # ------------------------------------------------------------------ names and tokenizer

    @property
    def val_names(self) -> list[str]:
        """Names of the validation dataloaders, in dataloader_idx order."""
        return list(self.val_sources)

    @property
    def train_source_names(self) -> dict[str, str]:
        """Source -> short name of each training source when there are several (the tags of
        ``train/reward_by_source/<name>``); empty for one source."""
        sources = [self.train_source] if isinstance(self.train_source, str) else list(self.train_source)
        return source_names(sources) if len(set(sources)) > 1 else {}

    @property
    def test_names(self) -> list[str]:
        """Names of the test dataloaders, in dataloader_idx order."""
        return list(self.test_sources)

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Use ``tokenizer`` for prompt ids (normally the model's); re-tokenizes if it changes."""
        if tokenizer is not self.tokenizer:
            self.tokenizer = tokenizer
            self._encoded.clear()

    def _resolve_tokenizer(self) -> Any:
        if self.tokenizer is None and self.tokenizer_name_or_path:
            from qerl.model import load_tokenizer  # the model loader's: tiny names, ids, dirs, .gguf

            self.set_tokenizer(load_tokenizer(self.tokenizer_name_or_path))
        if self.tokenizer is None and self.trainer is not None:
            module_tokenizer = getattr(self.trainer.lightning_module, "tokenizer", None)
            if module_tokenizer is not None:
                self.set_tokenizer(module_tokenizer)
        if self.tokenizer is None:
            raise RuntimeError(
                "PromptDataModule has no tokenizer: call datamodule.set_tokenizer(tokenizer), give the"
                " LightningModule a `tokenizer` attribute, or set data.tokenizer_name_or_path"
            )
        return self.tokenizer

    # ------------------------------------------------------------------ loading

    def setup(self, stage: str | None = None) -> None:
        """Load the raw examples the stage needs (``fit``: train + val; ``validate``; ``test``)."""
        for wanted, sources, key in (("validate", self.val_sources, "val_sources"), ("test", self.test_sources, "test_sources")):
            if stage == wanted and not sources:  # Lightning would run zero batches and exit 0
                raise ValueError(f"train.py {wanted} needs evaluation sets: set data.{key}, e.g. "
                                 f"{{gsm8k: data/gsm8k/test.jsonl, math500: data/math500/test.jsonl}}")
        if stage in (None, "fit"):
            self._load("train", "train")
        if stage in (None, "fit", "validate"):
            for name in self.val_sources:
                self._load("val", name)
        if stage in (None, "test"):
            for name in self.test_sources:
                self._load("test", name)
        if self.tokenizer is None and self.trainer is not None:
            module_tokenizer = getattr(self.trainer.lightning_module, "tokenizer", None)
            if module_tokenizer is not None and self.tokenizer_name_or_path:
                raise ValueError(f"data.tokenizer_name_or_path ({self.tokenizer_name_or_path!r}) is for the data module "
                                 "on its own; here prompts are tokenized with the model's tokenizer (model.model): "
                                 "remove it")
            if module_tokenizer is not None:
                self.set_tokenizer(module_tokenizer)

    def _source(self, kind: str, name: str) -> str:
        if kind == "train":
            return self.train_source
        return (self.val_sources if kind == "val" else self.test_sources)[name]

    def _load(self, kind: str, name: str) -> list[PromptExample]:
        key = (kind, name)
        if key not in self._raw:
            source = self._source(kind, name)
            if kind == "train":  # (several sources: one after the other; the stream shuffles them together)
                examples = []
                for one in [source] if isinstance(source, str) else source:
                    loaded = load_examples(one, self.split, self.layout, self.prompt_key, self.answer_key,
                                           limit=self.num_train_examples)
                    if not isinstance(source, str):
                        logger.info("train source %s: %d examples", one, len(loaded))
                    examples += loaded
            else:
                examples = load_examples(source, self.eval_split, limit=self.num_val_examples)
                self._left_out[key] = examples.num_skipped
            logger.info("%s set %r: %d examples from %s", kind, name, len(examples), source)
            self._raw[key] = list(examples)
        return self._raw[key]

    def _prepared(self, kind: str, name: str) -> tuple[list[PromptExample], list[list[int]]]:
        """Examples of one set with their prompt ids, prompts over the set's length limit dropped."""
        key = (kind, name)
        if key not in self._encoded:
            tokenizer = self._resolve_tokenizer()
            raw = self._load(kind, name)
            setting, limit = (("max_prompt_length", self.max_prompt_length) if kind == "train"
                              else ("max_eval_prompt_length", self.max_eval_prompt_length))
            kept, ids, dropped = encode_prompts(tokenizer, raw, self.system_prompt, limit, template=self.prompt_template,
                                                chat_template_kwargs=self.chat_template_kwargs)
            if dropped:
                logger.warning("%s set %r: dropped %d of %d prompts longer than data.%s=%d tokens",
                               kind, name, dropped, len(raw), setting, limit)
                self._left_out[key] = self._left_out.get(key, 0) + dropped
            if not kept:
                raise ValueError(f"{kind} set {name!r}: every prompt is longer than data.{setting}={limit}")
            self._encoded[key] = (kept, ids)
        return self._encoded[key]

    def rows_left_out(self, kind: str, name: str) -> int:
        """Rows of an evaluation set's source that are not evaluated: malformed ones (skipped and logged at
        load) and prompts over ``max_eval_prompt_length``; the report says so next to the score."""
        return self._left_out.get((kind, name), 0)

    def longest_prompt(self, kind: str) -> int:
        """Tokens of the longest prompt of the ``train`` set or of every ``eval`` (val and test) set
        loaded so far: what an engine's context must hold besides the new tokens."""
        keys = [("train", "train")] if kind == "train" else [k for k in self._raw if k[0] != "train"]
        return max((len(p) for key in keys if key in self._raw for p in self._prepared(*key)[1]), default=0)

    # ------------------------------------------------------------------ dataloaders

    def _rank_world(self) -> tuple[int, int]:
        if self.trainer is None:
            return 0, 1
        return int(self.trainer.global_rank), int(self.trainer.world_size)

    def train_dataloader(self) -> DataLoader:
        """The infinite training stream, starting at the current data position."""
        examples, ids = self._prepared("train", "train")
        rank, world_size = self._rank_world()
        self._position.check_resumed_settings(self._order_settings(len(examples), world_size))
        self._stream = PromptStream(
            examples, ids, self.prompts_per_step, self.seed, rank=rank, world_size=world_size,
            start=self._position.next_batch,
        )
        return _PromptStreamLoader(
            self._stream,
            get_start=lambda: self._position.next_batch,
            on_yield=self._mark_consumed if self._count_on_yield() else None,
            num_workers=self.num_workers,
        )

    def _eval_loaders(self, kind: str, names: Sequence[str]) -> list[DataLoader]:
        loaders = []
        for name in names:
            examples, ids = self._prepared(kind, name)
            loaders.append(
                DataLoader(
                    list(range(len(examples))),
                    batch_size=self.val_prompts_per_batch,
                    shuffle=False,
                    collate_fn=_EvalCollate(examples, ids),
                    num_workers=self.num_workers,
                )
            )
        return loaders

    def val_dataloader(self) -> list[DataLoader]:
        """One loader per ``val_sources`` entry, in order (empty list: no validation)."""
        return self._eval_loaders("val", self.val_names)

    def test_dataloader(self) -> list[DataLoader]:
        """One loader per ``test_sources`` entry, in order."""
        return self._eval_loaders("test", self.test_names)

    def draw_extra(self, num_prompts: int, seed: int, exclude: Collection[tuple[str, int]] = ()) -> PromptBatch:
        """Extra training prompts for DAPO dynamic sampling (refilling groups with no signal).

        Drawn from a side stream seeded by ``(self.seed, seed)``, so the main stream and its
        resumable position are untouched and a resumed run draws the same extras. ``exclude``:
        ``(source, index)`` of the prompts this step already has (every rank's batch, this rank's
        earlier refills), passed over while the data allows, so a prompt is not trained twice in one step. Under DDP every
        rank shuffles the same way and takes every ``world_size``-th prompt from its rank on: the
        ranks refill with different prompts (while the data allows), not W copies of the same ones."""
        examples, ids = self._prepared("train", "train")
        rank, world_size = self._rank_world()
        order = np.random.default_rng([self.seed, int(seed)]).permutation(len(examples))
        excluded = set(exclude)
        fresh = [int(i) for i in order[rank::world_size] if (examples[i].source, examples[i].index) not in excluded]
        want = min(num_prompts, len(examples))
        picks = fresh[:want]
        if len(picks) < want:  # too few left: the rest of the order (other ranks' or excluded prompts)
            taken = set(picks)
            picks += [int(i) for i in np.roll(order, -rank) if int(i) not in taken][:want - len(picks)]
        return collate_examples([examples[i] for i in picks], [ids[i] for i in picks])

    # ------------------------------------------------------------------ data position

    def _count_on_yield(self) -> bool:
        """Count consumption at the loader without a trainer; with one, at this DataModule's transfer
        hook (Lightning calls it, not a LightningModule's override, for every trained batch)."""
        return self.trainer is None

    def _mark_consumed(self, batch: Any) -> None:
        self._position.mark_consumed(batch, self._stream.batches_per_epoch if self._stream is not None else None)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Count a training batch as consumed when the Trainer hands it to the training step."""
        if self.trainer is not None and self.trainer.training:
            self._mark_consumed(batch)
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Data position for checkpoints: the next unseen batch ``(epoch, batch_in_epoch)`` and counts."""
        n = len(self._encoded[("train", "train")][0]) if ("train", "train") in self._encoded else None
        return self._position.state_dict(self._order_settings(n, self._rank_world()[1]))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the data position; the next training iteration starts at the next unseen batch."""
        self._position.load_state_dict(state_dict)

    def _order_settings(self, num_prompts: int | None, world_size: int) -> dict[str, Any]:
        """What fixes the training order besides the position: saved with it, compared on resume."""
        return {"seed": self.seed, "train_source": str(self.train_source), "prompts_per_step": self.prompts_per_step,
                "prompt_format": self._prompt_format(), "num_train_prompts": num_prompts, "world_size": world_size}

    def _prompt_format(self) -> str:
        """A short digest of what turns a question into a prompt (system prompt, template, chat
        template variables): a resume that changes it is warned like a changed source."""
        return prompt_format_digest(self.system_prompt, self.prompt_template, self.chat_template_kwargs)
