"""What ``QeRLModule``'s training step logs, and the cross-rank reductions its decisions need.

``_log_step`` writes one point per curve per rollout batch (README: "how to read TensorBoard");
``_warn_on_silent_failures`` keeps the streaks behind the zero-reward-std and truncation warnings.
Under DDP every decision that changes the number of backward passes (each one a gradient
all-reduce) is taken on all ranks together (``_on_all_ranks``), and dapo's token normaliser and the
high-entropy quantile see every rank's tokens; in one process all of these are plain local values.
"""

from __future__ import annotations

import torch
from lightning.pytorch.utilities import rank_zero_warn

from qerl.rollout import Rollout


def mostly_truncated(truncated: torch.Tensor) -> bool:
    """At least 90% of the flags set, by counts (36 of 40 is 0.8999999761 as a float32 mean)."""
    return 10 * int(truncated.sum()) >= 9 * truncated.numel()


class StepMetricsMixin:
    """Logging and rank reductions of ``QeRLModule`` (expects ``warn_after_steps``, ``_streaks`` and
    ``_world_size`` from the module and ``ResumeMixin``)."""

    def _log_step(self, rollout: Rollout, sums, losses, grad_norms, pre, train_time, lr, step: int,
                  updates: dict[str, int]) -> None:
        """One point per curve for this rollout batch (at ``step``, the optimizer step it started at);
        the update scalars are means over the applied updates (NaN when every update was skipped, or
        no token reached the loss: nothing was trained on). ``updates``: how many of the batch's updates
        were skipped (non-finite) and how many recomputed without cuDNN attention."""
        G = rollout.group_size
        applied = len(losses)
        # (a key is missing when no token reached the loss: every completion truncated under mask_truncated)
        update_mean = lambda key: sums[key] / applied if applied and key in sums else float("nan")  # noqa: E731
        pre_mean = lambda key, weight="weight": pre[key] / pre[weight] if pre[weight] else float("nan")  # noqa: E731
        rewards = rollout.rewards.float()
        group_std = rewards.view(-1, G).std(-1) if G > 1 else torch.zeros(rewards.numel())
        lengths = rollout.sampled_lengths().float()  # every generated completion (also DAPO's dropped groups)
        metrics = {
            "train/reward": rewards.mean(),
            # every sampled group's (DAPO's dynamic sampling trains on the mixed ones only)
            "train/reward_sampled": rollout.mean_sampled_reward(),
            "train/reward_std": group_std.mean(),
            "train/frac_reward_zero_std": (group_std < 1e-6).float().mean(),
            "train/entropy": pre_mean("entropy"),
            "train/kl": update_mean("kl"),
            "train/loss": sum(losses) / applied if applied else float("nan"),
            "train/clip_ratio/low": update_mean("clip_ratio/low"),
            "train/clip_ratio/high": update_mean("clip_ratio/high"),
            "train/clip_ratio/region": update_mean("clip_ratio/region"),
            "train/clip_ratio/dual": update_mean("clip_ratio/dual"),
            "train/is_ratio/mean": pre_mean("is_ratio", "is_weight"),  # over finite sampler log-probs
            "train/policy_ratio/mean": update_mean("ratio/mean"),  # pi / pi_old, 1 in update 0
            "train/completion_length/mean": lengths.mean(),
            "train/completion_length/max": lengths.max(),
            "train/clipped_ratio": rollout.sampled_truncated().float().mean(),
            "train/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
            "train/lr": lr,
            "train/groups_dropped": float(rollout.num_groups_dropped),
            # the same on every rank (decided together); 0 in a healthy run
            "train/updates_skipped": float(updates["skipped"]),
            "train/updates_recomputed": float(updates["recomputed"]),
            "time/train": train_time,
        }
        for name, values in rollout.reward_components.items():
            metrics[f"train/rewards/{name}"] = values.float().mean()
        for name, seconds in rollout.timings.items():
            metrics[f"time/{name}"] = seconds
        metrics = {k: torch.as_tensor(v, dtype=torch.float32, device=self.device) for k, v in metrics.items()}
        # DDP: the curves describe every rank's rollouts (means over ranks, the maximum length's max);
        # the keys are the same on every rank, so the reductions pair up. No-ops in one process.
        longest = {"train/completion_length/max": metrics.pop("train/completion_length/max")}
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=rewards.numel(), sync_dist=True)
        self.log_dict(longest, on_step=True, on_epoch=False, batch_size=rewards.numel(), sync_dist=True,
                      reduce_fx="max")
        # straight to the loggers (rank 0), only the sources this batch drew: through self.log a key
        # left out would repeat its last value (Lightning keeps on-step values); reduced over ranks
        by_source = self._reward_by_source(rollout)
        writes = getattr(self.trainer._logger_connector, "should_update_logs", True)  # (log_every_n_steps)
        if by_source and writes and self.trainer.is_global_zero:
            for logger in self.loggers:
                logger.log_metrics(by_source, step=step)
                logger.save()
        # the warning's own measure of signal: none in any generated group's task rewards (the logged
        # share counts the rewards trained on, where DAPO's overlong shaping separates completions by length)
        self._warn_on_silent_failures(rollout.frac_task_zero_std(), mostly_truncated(rollout.sampled_truncated()))

    def _reward_by_source(self, rollout: Rollout) -> dict[str, float]:
        """``train/reward_by_source/<name>`` with several training sources: the mean reward of each
        source's completions in this batch over every rank (sums and counts reduced, not a mean of
        the ranks' means); a source with no prompt in the batch gets no point this step."""
        names = getattr(self.trainer.datamodule, "train_source_names", None) or {}  # (the same on every rank)
        if not names:
            return {}
        index = {source: i for i, source in enumerate(names)}
        sources = rollout.sources if len(rollout.sources) == rollout.rewards.numel() else [""] * rollout.rewards.numel()
        rows = torch.tensor([index.get(source, -1) for source in sources], dtype=torch.long)  # (N,)
        known = rows >= 0
        totals = torch.zeros(2, len(names), dtype=torch.float64)  # (reward sum, completions) per source
        totals[0].index_add_(0, rows[known], rollout.rewards.detach().cpu().double()[known])
        totals[1].index_add_(0, rows[known], torch.ones(int(known.sum()), dtype=torch.float64))
        if self._world_size() > 1:
            totals = self.trainer.strategy.reduce(totals.to(self.device), reduce_op="sum").cpu()
        return {f"train/reward_by_source/{name}": float(totals[0, i] / totals[1, i])
                for i, name in enumerate(names.values()) if totals[1, i] > 0}

    def _warn_on_silent_failures(self, frac_zero_std: float, mostly_truncated: bool) -> None:
        """The classic silent failures: no reward signal, or >= 90% of the completions cut at max length
        (under DDP: on every rank, so rank 0's warning speaks for the run, not for its own shard)."""
        flat, truncated = self._on_all_ranks(frac_zero_std >= 1.0), self._on_all_ranks(mostly_truncated)
        self._streaks["zero_std"] = self._streaks["zero_std"] + 1 if flat else 0
        self._streaks["truncated"] = self._streaks["truncated"] + 1 if truncated else 0
        n = self.warn_after_steps
        if self._streaks["zero_std"] == n:
            rank_zero_warn(f"reward std has been 0 in every group for {n} rollout batches: no learning signal "
                           "from the task rewards (before any overlong shaping; check the reward function, answers, "
                           "and max_new_tokens)")
        if self._streaks["truncated"] == n:
            rank_zero_warn(f">= 90% of completions hit max_new_tokens for {n} rollout batches: raise max_new_tokens "
                           "or check the stop tokens")

    def token_normaliser(self, loss_mask: torch.Tensor) -> torch.Tensor:
        """dapo's denominator: the rollout batch's valid tokens over every rank divided by the world
        size W (DDP averages the ranks' gradients, so each rank divides its token sum by total / W and
        the average is the global token mean; a rank's own count would weight a token of a rank with
        short completions more). The count itself in one process."""
        count = loss_mask.sum().float()
        if self._world_size() > 1:
            count = self.trainer.strategy.reduce(count, reduce_op="mean")
        return count.clamp(min=1)

    def _from_every_rank(self, values: torch.Tensor) -> torch.Tensor | None:
        """Every rank's 1-D ``values`` (lengths may differ) concatenated; None in one process."""
        if self._world_size() <= 1:
            return None
        counts = self.all_gather(torch.tensor(values.numel(), device=values.device))  # (W,)
        padded = values.new_zeros(int(counts.max()))
        padded[: values.numel()] = values
        every = self.all_gather(padded)  # (W, max count)
        return torch.cat([row[: int(n)] for row, n in zip(every, counts)])

    def _on_all_ranks(self, flag: bool) -> bool:
        """``flag`` and-ed over the data-parallel ranks: a decision that changes the number of
        backward passes (each one a gradient all-reduce under DDP) must be taken by every rank."""
        if self._world_size() <= 1:
            return flag
        return self.trainer.strategy.reduce_boolean_decision(flag, all=True)
