"""The training prompt stream and batch collation behind `PromptDataModule` (``lightning_modules/data.py``).

`PromptStream` is an infinite, seeded, resumable iterator of prompt batches: epoch ``e`` visits the
prompts in a permutation fixed by ``(seed, e)``, sharded across ranks, and can start at any
``(epoch, batch)`` position. Batches are dicts of plain lists (`BATCH_KEYS`), never tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from qerl.data import PromptExample

BATCH_KEYS = ("prompt_ids", "prompts", "answers", "indices", "sources")


class PromptBatch(dict):
    """A batch dict (`BATCH_KEYS`) that also remembers where in the training stream it came from.

    ``position`` is ``(epoch, batch_in_epoch)`` for training batches and None for eval batches. It
    is an attribute, not a key, so the module sees exactly the documented keys.
    """

    position: tuple[int, int] | None = None


def collate_examples(
    examples: Sequence[PromptExample], prompt_ids: Sequence[list[int]], position: tuple[int, int] | None = None
) -> PromptBatch:
    """Build a `PromptBatch` of plain lists from parallel examples and prompt ids."""
    batch = PromptBatch(
        prompt_ids=[list(ids) for ids in prompt_ids],
        prompts=[ex.prompt for ex in examples],
        answers=[ex.answer for ex in examples],
        indices=[ex.index for ex in examples],
        sources=[ex.source for ex in examples],
    )
    batch.position = position
    return batch


def _identity(batch: Any) -> Any:
    return batch


class _EvalCollate:
    """Picklable collate_fn for eval loaders: dataset items are row numbers."""

    def __init__(self, examples: list[PromptExample], prompt_ids: list[list[int]]):
        self.examples = examples
        self.prompt_ids = prompt_ids

    def __call__(self, rows: list[int]) -> PromptBatch:
        return collate_examples([self.examples[i] for i in rows], [self.prompt_ids[i] for i in rows])


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order of ``n`` prompts in ``epoch``: a permutation determined only by ``(seed, epoch)``."""
    return np.random.default_rng([seed, epoch]).permutation(n)


class PromptStream(IterableDataset):
    """Infinite, seeded stream of training `PromptBatch` es that can start at any position.

    Global batch ``(epoch, b)`` is ``permutation(seed, epoch)[b*B*W : (b+1)*B*W]`` with
    ``B = batch_size`` and ``W = world_size``; rank ``r`` gets its ``r``-th slice of ``B``. Each
    epoch has ``n // (B*W)`` batches. With DataLoader workers, worker ``w`` of ``K`` yields the
    global batches ``k ≡ w (mod K)`` so the loader's round-robin keeps the order.
    """

    def __init__(
        self,
        examples: list[PromptExample],
        prompt_ids: list[list[int]],
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        start: tuple[int, int] = (0, 0),
    ):
        super().__init__()
        if len(examples) != len(prompt_ids):
            raise ValueError("examples and prompt_ids differ in length")
        self.examples = examples
        self.prompt_ids = prompt_ids
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.start = start
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{len(examples)} training prompts are fewer than one batch of {batch_size * world_size}"
                f" (prompts_per_step={batch_size} × world_size={world_size}); lower prompts_per_step or add data"
            )

    @property
    def batches_per_epoch(self) -> int:
        return len(self.examples) // (self.batch_size * self.world_size)

    def normalize(self, position: tuple[int, int]) -> tuple[int, int]:
        epoch, b = position
        if b >= self.batches_per_epoch:  # e.g. the data shrank since the checkpoint
            return epoch + 1, 0
        return epoch, b

    def __iter__(self) -> Iterator[PromptBatch]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, b = self.normalize(self.start)
        global_b = self.batch_size * self.world_size
        k = 0  # batches since the start position, for worker sharding
        while True:
            perm = epoch_permutation(len(self.examples), self.seed, epoch)
            for b in range(b, self.batches_per_epoch):
                if k % num_workers == worker:
                    lo = b * global_b + self.rank * self.batch_size
                    rows = perm[lo : lo + self.batch_size].tolist()
                    yield collate_examples(
                        [self.examples[i] for i in rows], [self.prompt_ids[i] for i in rows], position=(epoch, b)
                    )
                k += 1
            epoch, b = epoch + 1, 0


class _PromptStreamLoader(DataLoader):
    """DataLoader over a `PromptStream` that starts at the data module's position on every ``iter()``."""

    def __init__(
        self,
        stream: PromptStream,
        get_start: Callable[[], tuple[int, int]],
        on_yield: Callable[[PromptBatch], None] | None,
        num_workers: int = 0,
    ):
        super().__init__(stream, batch_size=None, collate_fn=_identity, num_workers=num_workers)
        self._get_start = get_start
        self._on_yield = on_yield

    def __iter__(self) -> Iterator[PromptBatch]:  # type: ignore[override]
        self.dataset.start = self._get_start()
        for batch in super().__iter__():
            if self._on_yield is not None:
                self._on_yield(batch)
            yield batch
