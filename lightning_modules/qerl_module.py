"""QeRLModule: GRPO / DAPO / Dr.GRPO on a frozen (NVFP4, NF4 or bf16) base with LoRA, manual optimization.

One ``training_step`` per rollout batch. The ``RolloutCallback`` has already generated and scored
``G`` completions per prompt and attached them as ``batch["rollout"]``; the step then reads top to
bottom:

1. group-normalized advantages (group std, batch std, or none);
2. no-grad passes: old log-probs (only when there is more than one update per rollout; otherwise
   the live log-probs *are* the old ones), the token entropies that pick the high-entropy tokens
   (only with ``top_entropy_quantile < 1``), and reference log-probs with the adapter disabled and
   AQN noise off (only when ``kl_coef > 0``);
3. ``updates_per_rollout`` optimizer steps, each accumulating gradients over micro-batches of the
   clipped surrogate (separate low/high clip), KL (``kl_estimator``), optional entropy bonus, truncated importance
   sampling against the sampler's log-probs, aggregated as grpo / bnpo / dapo / dr_grpo; then
   clip, step, schedule. Micro-batches hold completions of similar length (``group_by_length``)
   and every forward is cut to its own rows' extent, so padding costs little compute.

x-axes: every ``train/*`` and ``time/*`` scalar is logged once per rollout batch at
``trainer.global_step``, which counts optimizer steps (it grows by ``updates_per_rollout`` per
batch). Checkpoints hold only trainable parameters (LoRA, optional norms), optimizer, scheduler and
callback state; the frozen base is rebuilt from ``model`` on resume, and the config is what runs
(``lightning_modules/checkpointing.py``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
import warnings
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from qerl.attention_masks import cudnn_attention_enabled, without_cudnn_attention
from qerl.losses import group_advantages, high_entropy_mask, masked_mean, policy_loss, truncated_is_weights
from lightning_modules.checkpointing import ResumeMixin, _plain
from lightning_modules.policy_forward import PolicyForwardMixin, forward_window  # noqa: F401  (forward_window: benchmarks)
from lightning_modules.settings import LIGHTNING_ADVICE_THAT_DOES_NOT_APPLY, lr_factor, param_groups, step_count_warnings
from lightning_modules.settings import LossSettings, OptimizerSettings  # noqa: F401  (the CLI's model.loss, .optimizer)
from lightning_modules.evaluation import EvalSettings, EvaluationMixin, claim_unused_path  # noqa: F401  (EvalSettings: the CLI's model.eval)
from lightning_modules.step_metrics import StepMetricsMixin
from qerl.model import LoraSettings, enable_activation_checkpointing, load_policy, load_tokenizer
from qerl.norms import base_model_only
from qerl.rollout import Rollout
from qerl.seeding import resolve_seed
from qerl.settings_checks import require_counts, require_full_precision

log = logging.getLogger(__name__)


class QeRLModule(PolicyForwardMixin, ResumeMixin, EvaluationMixin, StepMetricsMixin, L.LightningModule):
    """The policy (frozen NVFP4/NF4/bf16 base + LoRA) and the RL update.

    Args:
        model: tiny-qwen2 | tiny-llama (built in code), a local directory, a Hugging Face id, or a .gguf file.
        quantization: nvfp4 (QeRL), nf4 (QLoRA baseline, bitsandbytes) or bf16 (16-bit LoRA) decoder linears.
        dtype: dtype of everything that is not NVFP4 (embeddings, norms, lm_head, activations).
        lora: adapter settings.
        loss: the RL objective.
        optimizer: AdamW and LR schedule.
        eval: evaluation settings (pass@1 greedy; mean@k / pass@k sampled).
        adapter_path: a peft adapter directory to load into the LoRA after building the model
            (evaluate or continue a trained adapter); null starts from peft's init (B = 0, i.e. the base).
        gradient_checkpointing: recompute activations in backward (long completions on big models).
        fused_ops: on CUDA, the training passes run RMSNorm (AQN noise included), the rotary embedding
            and SiLU(gate) * up as one Triton kernel each, forward and backward (``qerl.fused_ops``, as
            the embedded engine generates), and the NVFP4 q/k/v and gate/up bases as one linear each
            (``qerl.rollout.fast_linears.fused_base_projections``); false: transformers' eager ops.
        cudnn_attention: let SDPA pick its cuDNN backend in the training passes (the fastest with a
            padding mask on Hopper); the first update whose gradient comes out non-finite with it is
            recomputed without it, and the run trains without it from then on. false: never (1.9-2.5x
            slower masked attention, ~5% of a 7B update; ``qerl.attention_masks``).
        seed: seeds the tiny model's random init (real models ignore it); null: ``seed_everything``.
        warn_after_steps: warn when reward std is 0 or >= 90% of completions are truncated this many rollout
            batches in a row.
    """

    def __init__(
        self,
        model: str = "tiny-qwen2",
        quantization: Literal["bf16", "nf4", "nvfp4"] = "nvfp4",
        dtype: Literal["bf16", "fp32", "fp16"] = "bf16",
        lora: LoraSettings | None = LoraSettings(),
        loss: LossSettings | None = LossSettings(),
        optimizer: OptimizerSettings | None = OptimizerSettings(),
        eval: EvalSettings | None = EvalSettings(),
        adapter_path: str | None = None,
        gradient_checkpointing: bool = False,
        fused_ops: bool = True,
        cudnn_attention: bool = True,
        seed: int | None = None,
        warn_after_steps: int = 5,
    ):
        super().__init__()
        self.save_hyperparameters()
        for section in ("lora", "loss", "optimizer", "eval"):  # plain dicts, as the CLI passes them: a checkpoint's
            self.hparams[section] = _plain(self.hparams[section])  # weights_only load refuses the dataclasses
        self._hparams_initial = copy.deepcopy(self._hparams)  # (what loggers write to hparams.yaml)
        for message in LIGHTNING_ADVICE_THAT_DOES_NOT_APPLY:  # (before fit / validate / test start)
            warnings.filterwarnings("ignore", message=message)
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold only the trainable params
        self.model_name, self.quantization, self.dtype_name = model, quantization, dtype
        self.seed = resolve_seed(seed, "model.seed")
        # own copies: the defaults above are one instance per process (printed by --print_config and
        # saved in config.yaml, where null hid what ran), and a module may change its settings
        self.lora_settings = copy.deepcopy(lora or LoraSettings())
        self.loss_settings = copy.deepcopy(loss or LossSettings())
        self.optim_settings = copy.deepcopy(optimizer or OptimizerSettings())
        self.eval_settings = copy.deepcopy(eval or EvalSettings())
        self.adapter_path = adapter_path
        self.gradient_checkpointing = gradient_checkpointing
        self.fused_ops, self.cudnn_attention = fused_ops, cudnn_attention
        require_counts("model", (("warn_after_steps", warn_after_steps, 1, None),))  # 0 warned every healthy step
        self.warn_after_steps = warn_after_steps
        self.model: torch.nn.Module | None = None
        self._tokenizer = None
        # Set by AQNCallback: the noisy norms and whether training forwards see the noise too.
        self.noisy_norms = None
        self.aqn_apply_to: Literal["rollout", "both"] = "both"
        self._streaks = {"zero_std": 0, "truncated": 0, "skipped": 0}
        self._cudnn_failed = False  # cuDNN attention gave a non-finite gradient: off for the rest of the run

    # ---------------------------------------------------------------- model
    @property
    def tokenizer(self):
        """Loaded on first use (the DataModule needs it before ``configure_model`` runs)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_name)
        return self._tokenizer

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self._trainer is not None:  # (a Trainer built in Python; the CLI checks its config earlier)
            require_full_precision(self.trainer.precision)
        # Lightning may run this hook under a default-device context (the accelerator): load on the
        # CPU explicitly and let load_policy quantize layer by layer on the target device.
        device = self.trainer.strategy.root_device if self._trainer is not None else self.device
        if self.adapter_path:  # before minutes of loading
            self._check_adapter_base()
        with torch.device("cpu"):
            self.model, tokenizer = load_policy(
                self.model_name, self.quantization, self.lora_settings, dtype=self.dtype_name,
                device=device, seed=self.seed,
            )
        self._tokenizer = self._tokenizer or tokenizer
        self.model.train()  # loaders return eval mode; LoRA dropout must be live in training
        if self.lora_settings.dropout > 0 and (self._trainer is None or self.trainer.state.fn == "fit"):
            rank_zero_warn(f"lora.dropout = {self.lora_settings.dropout}: each training forward draws its own "
                           "dropout mask, so the old/new ratio is not 1 at the first update and the sampler "
                           "(no dropout) differs from the trainer; RL recipes use 0")
        if self.adapter_path:
            from qerl.adapter import load_adapter_into  # LoRA + trainable norms, as on_train_end wrote them

            load_adapter_into(self.model, self.adapter_path)
        if self.gradient_checkpointing:
            enable_activation_checkpointing(self.model)
        # DDP: every rank builds the same frozen base from `model`; broadcasting it is wasted traffic and
        # NVFP4 tensors cannot be flattened into DDP's buckets. Only trainable tensors are synced.
        frozen = [f"model.{n}" for n, p in self.model.named_parameters() if not p.requires_grad]
        frozen += [f"model.{n}" for n, _ in self.model.named_buffers()]
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self, frozen)

    def configure_callbacks(self):
        """Lightning's summary prints params x 4 B as the model size; this one the real bytes (NVFP4 packed).
        Checkpoint files are named by the optimizer step they hold (see ``callbacks/checkpoint.py``).
        Warns when a checkpoint interval or max_steps does not fit (see :func:`step_count_warnings`).
        A first Ctrl-C in fit stops after the rollout batch and saves ``last``, as a SIGTERM does."""
        from callbacks.checkpoint import CtrlCStopsAfterTheBatch, use_step_checkpoints
        from callbacks.summary import replace_default_progress_bar, replace_default_summary

        replace_default_summary(self.trainer.callbacks)
        replace_default_progress_bar(self.trainer.callbacks)  # "Epoch 0", not "Epoch 0/-2"
        use_step_checkpoints(self.trainer.callbacks)
        for message in step_count_warnings(self.trainer.callbacks, self.loss_settings.updates_per_rollout,
                                           self.trainer.max_steps):
            rank_zero_warn(message)
        return [CtrlCStopsAfterTheBatch()]

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def configure_optimizers(self):
        s = self.optim_settings
        opt = torch.optim.AdamW(param_groups(self.trainable_parameters(), s.weight_decay), lr=s.lr, betas=tuple(s.betas))
        if self.trainer is None or self.trainer.max_steps <= 0:
            got = None if self.trainer is None else self.trainer.max_steps
            raise ValueError(f"trainer.max_steps must be >= 1 for fit (got {got}): the prompt stream is endless, and "
                             "the LR schedule and the AQN stages are laid out over max_steps optimizer steps")
        total = self.trainer.max_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, total, s.warmup_ratio, s.schedule))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---------------------------------------------------------------- the step
    def training_step(self, batch: dict, batch_idx: int):
        cudnn = self.cudnn_attention and not self._cudnn_failed
        attention = contextlib.nullcontext() if cudnn else without_cudnn_attention()
        with self._fused_ops(), attention:
            self._rl_step(batch)

    def _rl_step(self, batch: dict) -> None:
        """One rollout batch: advantages, the no-grad passes, K updates over micro-batches, logging."""
        if "rollout" not in batch:  # attached by a callback at on_train_batch_start
            raise ValueError("fit needs a callbacks.RolloutCallback in trainer.callbacks: it generates and scores "
                             "the completions each training step learns from (see configs/quickstart.yaml)")
        rollout: Rollout = batch["rollout"].to(self.device)
        s = self.loss_settings
        opt, sched = self.optimizers(), self.lr_schedulers()
        t0 = time.perf_counter()
        # x-axis of every scalar of this batch (ours, the callbacks', AQN's): the optimizer step it
        # started at. Lightning uses a logged "step" value as the logger step instead of its batch count.
        first_step = self.global_step
        self.log("step", float(first_step), on_step=True, on_epoch=False, batch_size=1)

        N, T = rollout.completion_ids.shape  # N = prompts * G
        input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)  # (N, P+T)
        attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)  # (N, P+T)
        completion_mask = rollout.completion_mask.bool()  # (N, T): every sampled token (logged entropy, IS ratio)
        loss_mask = completion_mask  # (N, T): the tokens the loss trains on
        if s.mask_truncated:
            loss_mask = loss_mask & ~rollout.truncated[:, None]
        # DDP: "batch" scales by the std of every rank's rewards (the ranks keep equal group counts)
        everyone = self.all_gather(rollout.rewards) if s.advantage_scale == "batch" and self._world_size() > 1 else None
        advantages = group_advantages(rollout.rewards, rollout.group_size, s.advantage_scale,
                                      batch_rewards=everyone)  # (N,)
        completion_ids, sampler_logprobs = rollout.completion_ids, rollout.sampler_logprobs  # (N, T) each
        if s.group_by_length and s.aggregation != "bnpo":  # similar lengths share a micro-batch (cut to its rows)
            rows = torch.argsort(rollout.completion_mask.sum(-1), stable=True)  # (N,)
            input_ids, attention_mask, completion_ids = input_ids[rows], attention_mask[rows], completion_ids[rows]
            loss_mask, advantages, sampler_logprobs = loss_mask[rows], advantages[rows], sampler_logprobs[rows]
            completion_mask = completion_mask[rows]
        micro_batches = [slice(i, min(i + s.micro_batch_size, N)) for i in range(0, N, s.micro_batch_size)]
        lp = lambda mb, **kw: self.completion_logprobs(  # noqa: E731
            input_ids[mb], attention_mask[mb], completion_ids[mb], rollout.temperature, **kw)

        # 2. no-grad passes
        old_logprobs = ref_logprobs = high_entropy = pre_entropy = None
        top_entropy = s.top_entropy_quantile < 1.0
        with torch.no_grad():
            if s.updates_per_rollout > 1 or top_entropy:
                with self._training_noise():
                    passes = [lp(mb, with_entropy=top_entropy) for mb in micro_batches]
                if s.updates_per_rollout > 1:
                    old_logprobs = torch.cat([logprobs for logprobs, _ in passes])  # (N, T)
                if top_entropy:  # the rollout's forking tokens, fixed for the K updates
                    pre_entropy = torch.cat([h for _, h in passes])  # (N, T); also the logged entropy
                    high_entropy = high_entropy_mask(  # (N, T); DDP: one threshold over every rank's tokens
                        pre_entropy, loss_mask, s.top_entropy_quantile,
                        all_entropies=self._from_every_rank(pre_entropy[loss_mask]))
                del passes
            if s.kl_coef > 0:
                noise_off = self.noisy_norms.disable() if self.noisy_norms is not None else contextlib.nullcontext()
                with base_model_only(self.model), noise_off:  # LoRA off, trained norms at their base values
                    ref_logprobs = torch.cat([lp(mb)[0] for mb in micro_batches])  # (N, T)

        # 3. K updates, each accumulating over micro-batches. An update's scalars (loss, kl, clip
        # ratios, grad norm) count only once it is applied; entropy and IS ratio are pre-update values
        # read in update 0's pass, skipped or not.
        lr = opt.param_groups[0]["lr"]  # the LR of this step's first update (logged as train/lr)
        loss_tokens = loss_mask.sum().item()
        local_tokens = max(loss_tokens, 1)  # weights of this rank's logged means
        sampled_tokens = completion_mask.sum().clamp(min=1).item()  # (the pre-update ones: every sampled token)
        num_tokens = self.token_normaliser(loss_mask)  # dapo's: the global token count / W
        sums: dict[str, float] = {}  # the applied updates' metrics, summed over updates
        losses, grad_norms = [], []  # one per applied update
        pre = {"entropy": 0.0, "is_ratio": 0.0, "weight": 0.0, "is_weight": 0.0}

        def run_update(update: int):
            """One update's forward + backward over the micro-batches (gradients accumulate); returns
            (finite loss on every micro-batch, summed loss, its metrics, the gradient norm before clipping)."""
            finite, update_loss, update_sums = True, 0.0, {}
            if update == 0:
                pre.update(entropy=0.0, is_ratio=0.0, weight=0.0, is_weight=0.0)
            for mb in micro_batches:
                with self._training_noise():
                    logprobs, entropy = lp(mb, with_entropy=(update == 0 and pre_entropy is None),
                                           entropy_grad=s.entropy_coef > 0)
                old = old_logprobs[mb] if old_logprobs is not None else logprobs.detach()
                is_weights = None
                if s.tis_cap is not None:
                    is_weights = truncated_is_weights(old, sampler_logprobs[mb], loss_mask[mb],
                                                      level=s.tis_level, mode=s.tis_mode, cap=s.tis_cap)
                if high_entropy is not None:  # the surrogate on those tokens only (a 0/1 token weight)
                    keep = high_entropy[mb].to(logprobs.dtype)
                    is_weights = keep if is_weights is None else is_weights * keep
                loss, metrics = policy_loss(
                    logprobs, old, advantages[mb], loss_mask[mb], clip_low=s.clip_low, clip_high=s.clip_high,
                    dual_clip=s.dual_clip, aggregation=s.aggregation, ratio_level=s.ratio_level,
                    is_weights=is_weights, ref_logprobs=None if ref_logprobs is None else ref_logprobs[mb],
                    kl_coef=s.kl_coef, kl_estimator=s.kl_estimator, entropy=entropy, entropy_coef=s.entropy_coef, max_completion_length=rollout.max_new_tokens,
                    num_tokens_total=num_tokens, num_sequences_total=N,
                )
                if s.aggregation == "bnpo":  # a local token mean: average over micro-batches
                    loss = loss / len(micro_batches)
                # DDP: all ranks decide together (and so take the same branches below)
                finite = finite and self._on_all_ranks(bool(torch.isfinite(loss)))
                weight = loss_mask[mb].sum().item() / local_tokens
                if finite:
                    with self._training_noise():  # gradient checkpointing recomputes the forward in here
                        self.manual_backward(loss)
                    update_loss += float(loss.detach())
                    for k, v in metrics.items():
                        update_sums[k] = update_sums.get(k, 0.0) + float(v) * weight
                elif update > 0:
                    break  # this update is lost; the pre-update scalars are complete
                if update == 0:  # (a skipped update 0 still reads them from every micro-batch)
                    # the pre-update entropy: the no-grad pass's when there was one (same weights, same
                    # noise); over every sampled token, also those mask_truncated keeps out of the loss
                    logged_entropy = pre_entropy[mb] if pre_entropy is not None else entropy.detach()
                    sampled = completion_mask[mb]
                    share = sampled.sum().item() / sampled_tokens
                    pre["entropy"] += float(masked_mean(logged_entropy, sampled)) * share
                    raw_ratio = torch.exp((old - sampler_logprobs[mb]).clamp(max=20))
                    # a NaN / -inf sampler log-prob (IS weight 0 or the cap in the loss) is left out here: not
                    # the step's mean (NaN), nor e^20 after the clamp
                    valid = sampled.bool() & torch.isfinite(sampler_logprobs[mb]) & torch.isfinite(raw_ratio)
                    valid_share = valid.sum().item() / sampled_tokens
                    pre["is_ratio"] += float(masked_mean(raw_ratio.nan_to_num(0.0), valid)) * valid_share
                    pre["is_weight"] += valid_share
                    pre["weight"] += share
            # the norm first, clipped only when finite: a NaN norm's clip factor would make every
            # gradient NaN and hide which ones were (the skip warning names them)
            params = self.trainable_parameters()
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            if torch.isfinite(grad_norm):
                torch.nn.utils.clip_grads_with_norm_(params, self.optim_settings.max_grad_norm, grad_norm)
            return finite, update_loss, update_sums, grad_norm

        recomputed = 0  # updates recomputed without cuDNN attention (train/updates_recomputed)
        for update in range(s.updates_per_rollout):
            with without_cudnn_attention() if self._cudnn_failed else contextlib.nullcontext():
                finite, update_loss, update_sums, grad_norm = run_update(update)
            cudnn_was_on = not self._cudnn_failed and cudnn_attention_enabled(self.device)
            if finite and not torch.isfinite(grad_norm) and cudnn_was_on:
                # cuDNN's attention backward gave non-finite gradients on the H200 (qerl.attention_masks):
                # the same update again without it, and the rest of the run without it (the shapes that
                # fail tend to recur: a recompute costs a whole update, leaving cuDNN out ~5% of one)
                rank_zero_warn(f"non-finite gradient norm at step {self.global_step} (cuDNN attention on, whose "
                               "backward can give NaN): recomputing this update without it and training without "
                               "it from now on (model.cudnn_attention: false leaves it out from the start)")
                self._cudnn_failed = True
                opt.zero_grad(set_to_none=True)
                recomputed += 1
                with without_cudnn_attention():
                    finite, update_loss, update_sums, grad_norm = run_update(update)
            if not finite or not torch.isfinite(grad_norm):
                # A NaN/inf must never reach the weights: drop the whole update (partial grads too).
                what = "loss" if not finite else "gradient norm"
                where = "" if not finite else f" ({self.non_finite_gradients()})"
                rank_zero_warn(f"non-finite {what}{where} at step {self.global_step}: skipping this update (the "
                               "step counts, the weights do not change)")
                opt.zero_grad(set_to_none=True)
                # the update's slot is spent: global_step and the LR schedule advance as if it had run,
                # so a rollout batch stays K steps (checkpoint and log intervals, max_steps line up)
                opt._on_before_step()  # Lightning's step counter, without optimizer.step()
                opt._on_after_step()
                sched.step()
                self._streaks["skipped"] += 1
                if self._streaks["skipped"] >= 10:  # else max_steps is never reached: fail loudly
                    raise self.skipped_streak_error(what)
                continue
            self._streaks["skipped"] = 0
            if loss_tokens:  # else (every completion truncated under mask_truncated) no per-token means: NaN, not 0
                for k, v in update_sums.items():
                    sums[k] = sums.get(k, 0.0) + v
            losses.append(update_loss)
            grad_norms.append(float(grad_norm))
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            self.check_weights_finite()  # before this step's checkpoint

        updates = {"skipped": s.updates_per_rollout - len(losses), "recomputed": recomputed}
        self._log_step(rollout, sums, losses, grad_norms, pre, time.perf_counter() - t0, lr, first_step, updates)

    # ---------------------------------------------------------------- the adapter
    def on_train_end(self) -> None:
        """Write the adapter in peft format next to the logs (what users serve or evaluate)."""
        log_dir = self.trainer.log_dir  # a collective under DDP: every rank asks, rank 0 writes
        if self.trainer.is_global_zero and log_dir:
            from qerl.adapter import export_adapter  # LoRA + trainable norms, peft format

            out = claim_unused_path(f"{log_dir}/adapter", directory=True)  # a logger-less run's log_dir is shared
            export_adapter(self.model, out, base=self.base_record())  # (for qerl.export)
            if not out.endswith("/adapter"):
                rank_zero_warn(f"{log_dir}/adapter holds an earlier run's adapter: this run's is in {out}")
