"""Where `PromptDataModule`'s training stream stands (``lightning_modules/data.py``), for resuming.

`DataPosition` holds the next unseen training batch ``(epoch, batch_in_epoch)`` and how many batches
were consumed. A checkpoint stores it with the settings that fix the training order (seed, sources,
prompt format, ...); on resume, the settings of the run that continues are compared with those once,
when its training stream is built, and a change is warned (the order after resume then differs).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("lightning_modules.data")  # (the data module's logger: its warnings read as the module's)


class DataPosition:
    """The next unseen training batch, the batches consumed, and the checkpoint's settings from
    `load_state_dict` until `check_resumed_settings` has compared them."""

    def __init__(self) -> None:
        self.next_batch: tuple[int, int] = (0, 0)
        self.batches_consumed = 0
        self._loaded: dict[str, Any] | None = None

    def mark_consumed(self, batch: Any, batches_per_epoch: int | None) -> None:
        """Move past a training batch (its ``position``; an eval batch has none and is ignored); after
        an epoch's last batch (``batches_per_epoch``; None: not known yet) comes the next epoch's first."""
        position = getattr(batch, "position", None)
        if position is None:
            return
        epoch, b = position
        b += 1
        if batches_per_epoch is not None and b >= batches_per_epoch:
            epoch, b = epoch + 1, 0
        self.next_batch = (epoch, b)
        self.batches_consumed += 1

    def state_dict(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """The position and counts, then ``settings`` (what fixes the training order), for a checkpoint."""
        epoch, b = self.next_batch
        return {"epoch": epoch, "batch_in_epoch": b, "batches_consumed": self.batches_consumed, **settings}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the position; the checkpoint's settings are kept for `check_resumed_settings`."""
        self.next_batch = (int(state_dict["epoch"]), int(state_dict["batch_in_epoch"]))
        self.batches_consumed = int(state_dict.get("batches_consumed", 0))
        self._loaded = dict(state_dict)

    def check_resumed_settings(self, now: Mapping[str, Any]) -> None:
        """Warn about each of ``now`` that differs from the loaded checkpoint's (one it does not record
        is not compared); once per `load_state_dict`, nothing without one. A new global batch size
        (``prompts_per_step`` x ``world_size``) converts the position: the checkpoint counted batches
        of its own size, so batch b would otherwise be read at another prompt offset of the epoch."""
        meta, self._loaded = self._loaded, None
        if not meta:
            return
        old_size, new_size = _global_batch(meta), _global_batch(now)
        if old_size and new_size and old_size != new_size and self.next_batch[1] > 0:
            epoch, b = self.next_batch
            offset = b * old_size  # prompts of this epoch's permutation already trained on
            self.next_batch = (epoch, -(-offset // new_size))  # the first batch after them: none repeats
            logger.info("data position: batch %d of %d prompts = batch %d of %d (epoch %d)", b, old_size,
                        self.next_batch[1], new_size, epoch)
        changed = {k: (meta.get(k), v) for k, v in now.items() if meta.get(k) is not None and meta.get(k) != v}
        if changed:
            logger.warning(
                "resuming the data stream with changed settings %s (checkpoint → now); the training order"
                " after resume differs from the original run",
                changed,
            )


def _global_batch(settings: Mapping[str, Any]) -> int | None:
    """Prompts per global training batch (``prompts_per_step`` x ``world_size``), None if unrecorded."""
    per_rank, world = settings.get("prompts_per_step"), settings.get("world_size")
    return int(per_rank) * int(world) if per_rank and world else None
