"""QeRLModule.training_step at module level: a real Lightning Trainer, the module's own AdamW and
LR scheduler, a tiny random NVFP4 + LoRA policy, and a hand-made rollout batch (no engine, no reward).

What is pinned here (qerl/losses.py's micro-batch accumulation contract, seen through the module):
- grpo / dapo / dr_grpo: the gradients of both updates, the logged scalars and the updated LoRA
  weights do not depend on ``micro_batch_size`` (with ``updates_per_rollout=2``, the k3 KL on,
  overlong masking and sequence-level IS on). bnpo is the documented exception: a token mean per
  micro-batch, equal to the full batch only when the micro-batches hold equally many tokens;
- ``updates_per_rollout=K`` makes exactly K optimizer steps per rollout (``global_step`` += K);
- token- vs sequence-level importance weights and truncate vs mask each change the update when the
  sampler's log-probs differ from the trainer's, and none of them changes it when they agree.
"""

import copy
import math
import re
import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_modules.qerl_module import LossSettings, OptimizerSettings, QeRLModule
from qerl.aqn import attach_noisy_norms
from qerl.model import enable_activation_checkpointing
from qerl.rollout import Rollout

N, G, T, P = 8, 4, 6, 5  # completions, group size, completion length (= max_new_tokens), prompt length
# Rows 0 and 4 hit max_new_tokens (truncated). With mask_truncated the valid tokens per row are
# [0, 2, 5, 1 | 0, 3, 4, 1]: micro-batches of 4 hold 8 + 8 tokens (equal), micro-batches of 3 hold
# 7 + 4 + 6 (unequal). That is what separates bnpo's two cases below.
LENGTHS = torch.tensor([6, 2, 5, 1, 6, 3, 4, 1])
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.0])  # two groups of 4, both with signal
LR = 5e-3  # constant; large enough that a rollout's second update is off-policy (ratios != 1, some clipped)
# The sampler's log-probs are the trainer's plus this per-token offset, so log(pi_train / pi_sampler)
# = -offset in (-0.6, 1.2): some tokens and some sequences are above the IS cap log(2), some below.
OFFSET = torch.empty(N, T).uniform_(-1.2, 0.6, generator=torch.Generator().manual_seed(2))
# micro-batch invariance setting: K = 2 updates, KL on, overlong masking on, sequence-level TIS on
INVARIANCE = dict(updates_per_rollout=2, kl_coef=0.05, mask_truncated=True, tis_level="sequence",
                  tis_mode="truncate", tis_cap=2.0)


def build_policy() -> torch.nn.Module:
    """The tiny NVFP4 policy with LoRA (what ``configure_model`` builds), once per module.

    peft initialises LoRA B to 0, which makes every A gradient 0 in the first update; a seeded
    non-zero B gives every LoRA parameter a gradient and the adapter-off KL reference something
    to differ from."""
    module = QeRLModule(model="tiny-qwen2", quantization="nvfp4", dtype="fp32", seed=0)  # not PL_GLOBAL_SEED
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # peft draws LoRA A from the global generator (module-scoped: before conftest's seeding)
        module.configure_model()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return module.model


def make_rollout(policy: torch.nn.Module, offset: torch.Tensor) -> Rollout:
    """A rollout batch whose sampler log-probs are ``policy``'s own log-probs plus ``offset``."""
    gen = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(10, 90, (N, P), generator=gen)
    prompt_mask = torch.ones(N, P, dtype=torch.long)
    prompt_ids[0, :2], prompt_mask[0, :2] = 0, 0  # one left-padded prompt
    completion_mask = (torch.arange(T)[None] < LENGTHS[:, None]).long()
    completion_ids = torch.randint(10, 90, (N, T), generator=gen) * completion_mask
    probe = QeRLModule(model="tiny-qwen2", quantization="nvfp4", dtype="fp32")
    probe.model = policy
    with torch.no_grad():
        trainer_logprobs, _ = probe.completion_logprobs(
            torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1),
            completion_ids, temperature=1.0)
    sampler_logprobs = (trainer_logprobs + offset) * completion_mask
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, sampler_logprobs, REWARDS.clone(),
                   {}, LENGTHS == T, G, 1.0, T)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The matmuls here are tiny: a second intra-op thread buys nothing, while on a busy machine
    OpenMP's spin-waiting makes every op many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def policy():
    return build_policy()


@pytest.fixture(scope="module")
def mismatched(policy):
    """Sampler log-probs differ from the trainer's (as with vLLM's FP4 kernel or rollout-only AQN)."""
    return make_rollout(policy, OFFSET)


class Recorder(L.Callback):
    """Per optimizer step: the (clipped) gradients the optimizer is about to apply; per batch: the
    optimizer steps it made and ``global_step`` after it."""

    def __init__(self):
        self.grads, self.steps_per_batch, self.global_steps, self._count = [], [], [], 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._count += 1
        self.grads.append([p.grad.detach().clone() for p in pl_module.trainable_parameters()])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps_per_batch.append(self._count)
        self.global_steps.append(trainer.global_step)
        self._count = 0


def fit(policy, rollout, root, batches: int = 1, max_grad_norm: float = 0.2, module_kw=None, rollout_noise=0.0,
        module_class=QeRLModule, noise_apply_to="rollout", **loss_kw) -> SimpleNamespace:
    """``Trainer.fit`` a copy of ``policy`` on ``batches`` copies of ``rollout`` (one epoch, CPU).
    ``rollout_noise`` > 0: AQN noise of that sigma set on the norms with ``apply_to: noise_apply_to``
    (default rollout, as after the rollout: the training forwards must run without it)."""
    optimizer = OptimizerSettings(lr=LR, warmup_ratio=0.0, schedule="constant", max_grad_norm=max_grad_norm)
    module = module_class(model="tiny-qwen2", quantization="nvfp4", dtype="fp32", loss=LossSettings(**loss_kw),
                          optimizer=optimizer, **(module_kw or {}))
    module.model = copy.deepcopy(policy)  # configure_model keeps a model that is already there
    if module.gradient_checkpointing:
        enable_activation_checkpointing(module.model)
    if rollout_noise > 0:
        module.noisy_norms, module.aqn_apply_to = attach_noisy_norms(module.model), noise_apply_to
        module.noisy_norms.set_noise(rollout_noise, seed=1, step=0)
    before = [p.detach().clone() for p in module.trainable_parameters()]
    recorder = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=batches * module.loss_settings.updates_per_rollout,
                        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[recorder], default_root_dir=root)
    data = [{"rollout": copy.deepcopy(rollout)} for _ in range(batches)]
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=None, collate_fn=lambda batch: batch))
    return SimpleNamespace(
        grads=recorder.grads, steps_per_batch=recorder.steps_per_batch, global_steps=recorder.global_steps,
        before=before, after=[p.detach().clone() for p in module.trainable_parameters()],
        logged={k: float(v) for k, v in trainer.logged_metrics.items() if k.startswith("train/")},
        trainer=trainer, module=module,
    )


def max_abs(tensors) -> float:
    return max(t.abs().max().item() for t in tensors)


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def assert_same_update(a: SimpleNamespace, b: SimpleNamespace, what: str) -> None:
    """Same gradients at every optimizer step (to fp32 summation order), same LoRA weights after.
    From the second update on the tolerance is 10x looser: AdamW's first step (lr * g / (|g| + eps))
    turns summation-order rounding in near-zero gradient entries into weight differences of up to
    a good part of a step, which the next gradient sees (measured: 1.75e-7 against a scale of 1.2e-2, run to run)."""
    assert len(a.grads) == len(b.grads)
    for u, (ga, gb) in enumerate(zip(a.grads, b.grads)):
        scale = max_abs(ga)
        assert scale > 0, f"{what}: update {u} has an all-zero gradient"
        assert max_diff(ga, gb) <= (1e-5 if u == 0 else 1e-4) * scale, (what, u, max_diff(ga, gb), scale)
    # AdamW's first step is lr * g / (|g| + eps): it turns fp32 rounding in a gradient entry near eps
    # into a weight difference of up to a good part of a step (MKL's summation order depends on the
    # buffers' alignment, so such an entry differs from run to run: 2e-2 * LR seen), so the largest
    # difference gets a tolerance in units of the step size and the mean a tight one: an update that
    # really differs moves most entries by ~LR.
    diffs = torch.cat([(x - y).abs().flatten() for x, y in zip(a.after, b.after, strict=True)])
    assert diffs.max() <= 0.1 * LR and diffs.mean() <= 1e-3 * LR, (what, float(diffs.max()), float(diffs.mean()))


def assert_different_update(a: SimpleNamespace, b: SimpleNamespace, what: str) -> None:
    """The first update's gradient differs by far more than rounding."""
    scale = max_abs(a.grads[0])
    assert max_diff(a.grads[0], b.grads[0]) > 1e-2 * scale, (what, max_diff(a.grads[0], b.grads[0]), scale)


# ------------------------------------------------------------------------------------------------
# micro-batch invariance


@pytest.mark.parametrize("aggregation", ["grpo", "dapo", "dr_grpo"])
def test_update_does_not_depend_on_micro_batch_size(policy, mismatched, tmp_path, aggregation):
    whole = fit(policy, mismatched, tmp_path / "mb8", micro_batch_size=8, aggregation=aggregation, **INVARIANCE)
    split = fit(policy, mismatched, tmp_path / "mb3", micro_batch_size=3, aggregation=aggregation, **INVARIANCE)

    # the setting is not vacuous: two steps; the KL reference pass ran; the second update is
    # off-policy (clipping active; the first update's ratios are all 1) and has its own gradient
    assert whole.steps_per_batch == split.steps_per_batch == [2]
    assert whole.logged["train/kl"] > 0
    assert whole.logged["train/clip_ratio/region"] > 0
    assert max_diff(whole.grads[0], whole.grads[1]) > 0.1 * max_abs(whole.grads[0])
    assert max_diff(whole.before, whole.after) > 0.5 * LR

    assert_same_update(whole, split, aggregation)
    # every logged scalar (loss summed over micro-batches, token-weighted metrics) agrees as well
    assert whole.logged.keys() == split.logged.keys()
    for key, value in whole.logged.items():
        assert split.logged[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("aggregation", ["grpo", "dapo", "dr_grpo"])
def test_length_grouped_micro_batches_give_the_same_update(policy, mismatched, tmp_path, aggregation, monkeypatch):
    """``group_by_length`` sorts the rows by completion length before cutting micro-batches of 3 (the
    lengths 6 2 5 1 | 6 3 4 1 become 1 1 2 | 3 4 5 | 6 6), and every forward runs on its
    micro-batch's own extent: narrower forwards, the same update and scalars."""
    widths = []
    forward = QeRLModule.completion_logprobs

    def spy(self, input_ids, attention_mask, completion_ids, *args, **kwargs):
        used = attention_mask.any(0).nonzero()
        widths.append(int(used[-1]) + 1 - P)          # the completion columns this forward needs
        return forward(self, input_ids, attention_mask, completion_ids, *args, **kwargs)

    monkeypatch.setattr(QeRLModule, "completion_logprobs", spy)
    in_order = fit(policy, mismatched, tmp_path / "order", micro_batch_size=3, aggregation=aggregation,
                   **dict(INVARIANCE, group_by_length=False))
    order_widths, widths[:] = widths[:], []
    grouped = fit(policy, mismatched, tmp_path / "grouped", micro_batch_size=3, aggregation=aggregation, **INVARIANCE)
    # per pass over the 3 micro-batches: in rollout order 6, 6, 4 completion columns; grouped 2, 5, 6
    assert order_widths[:3] == [6, 6, 4] and widths[:3] == [2, 5, 6], (order_widths[:3], widths[:3])
    assert_same_update(in_order, grouped, f"{aggregation}, grouped by length")
    for key, value in in_order.logged.items():
        assert grouped.logged[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_bnpo_is_a_token_mean_per_micro_batch(policy, mismatched, tmp_path):
    """bnpo's docstring: the loss of a micro-batch is its own token mean, averaged over micro-batches.
    So it equals dapo's whole-batch token mean with one micro-batch, and with micro-batches of equal
    token counts (8 + 8: every token weighs 1 / (2 * 8) = 1 / 16, as in the whole-batch mean), but
    not with unequal ones (7 + 4 + 6: a token of the 4-token micro-batch weighs 1 / (3 * 4), not 1 / 17)."""
    in_order = dict(INVARIANCE, group_by_length=False)   # (bnpo ignores it: rollout order always)
    whole = fit(policy, mismatched, tmp_path / "mb8", micro_batch_size=8, aggregation="bnpo", **in_order)
    dapo = fit(policy, mismatched, tmp_path / "dapo", micro_batch_size=8, aggregation="dapo", **in_order)
    equal = fit(policy, mismatched, tmp_path / "mb4", micro_batch_size=4, aggregation="bnpo", **in_order)
    unequal = fit(policy, mismatched, tmp_path / "mb3", micro_batch_size=3, aggregation="bnpo", **in_order)

    assert_same_update(whole, dapo, "bnpo == dapo with one micro-batch")
    assert_same_update(whole, equal, "bnpo, micro-batches of equal token counts")
    assert whole.logged["train/loss"] == pytest.approx(equal.logged["train/loss"], rel=1e-5, abs=1e-7)
    assert_different_update(whole, unequal, "bnpo, micro-batches of unequal token counts")
    assert abs(whole.logged["train/loss"] - unequal.logged["train/loss"]) > 1e-2 * abs(whole.logged["train/loss"])
    # bnpo keeps rollout order under group_by_length (sorted micro-batches would weigh the tokens of
    # short completions up, not a speed setting's business)
    grouped = fit(policy, mismatched, tmp_path / "mb3g", micro_batch_size=3, aggregation="bnpo", **INVARIANCE)
    assert_same_update(unequal, grouped, "bnpo ignores group_by_length")


# ------------------------------------------------------------------------------------------------
# updates_per_rollout


def test_updates_per_rollout_makes_k_optimizer_steps_per_rollout(policy, mismatched, tmp_path):
    K = 3
    run = fit(policy, mismatched, tmp_path, batches=2, updates_per_rollout=K)
    assert run.steps_per_batch == [K, K]  # optimizer steps inside each training_step
    assert run.global_steps == [K, 2 * K]  # global_step counts optimizer steps
    assert run.trainer.global_step == 2 * K
    optimizer = run.trainer.optimizers[0]
    assert {int(optimizer.state[p]["step"]) for p in run.module.trainable_parameters()} == {2 * K}
    assert run.trainer.lr_scheduler_configs[0].scheduler.last_epoch == 2 * K  # one scheduler step per update


def test_the_kl_estimator_reaches_the_update(policy, mismatched, tmp_path):
    """kl_estimator k2 vs the default k3: another logged KL and another update, both finite; the KL
    term is the only difference (k1's on-policy gradient averages to zero, so it is checked for a value)."""
    kw = dict(updates_per_rollout=2, micro_batch_size=4, kl_coef=0.5)
    runs = {e: fit(policy, mismatched, tmp_path / e, kl_estimator=e, **kw) for e in ("k1", "k2", "k3")}
    for e, run in runs.items():
        assert math.isfinite(run.logged["train/kl"]) and math.isfinite(run.logged["train/loss"]), e
    assert runs["k2"].logged["train/kl"] != runs["k3"].logged["train/kl"]
    assert max_diff(runs["k2"].after, runs["k3"].after) > 0


def test_a_skipped_update_logs_no_partial_values(policy, mismatched, tmp_path):
    """A NaN reward in the second micro-batch skips both updates: the weights stay, the update
    scalars are NaN (not the first micro-batch's share, which looked like a small real loss), and
    the pre-update entropy / IS ratio (what the adaptive AQN controller reads) are the clean run's."""
    kw = dict(updates_per_rollout=2, micro_batch_size=3, kl_coef=0.05, group_by_length=False)  # rows in order
    clean = fit(policy, mismatched, tmp_path / "clean", **kw)
    broken = copy.deepcopy(mismatched)
    broken.rewards[5] = float("nan")  # group 2 (rows 4-5) of micro-batch 1 (rows 3-5)
    with pytest.warns(UserWarning, match="non-finite loss"):
        skipped = fit(policy, broken, tmp_path / "nan", **kw)
    assert max_diff(skipped.before, skipped.after) == 0.0
    for key in ("train/loss", "train/kl", "train/grad_norm", "train/clip_ratio/low"):
        assert math.isnan(skipped.logged[key]), (key, skipped.logged[key])
    for key in ("train/entropy", "train/is_ratio/mean"):
        assert abs(skipped.logged[key] - clean.logged[key]) <= 1e-6 * abs(clean.logged[key]), key
    assert skipped.trainer.global_step == 2
    assert skipped.logged["train/updates_skipped"] == 2 and clean.logged["train/updates_skipped"] == 0
    assert skipped.logged["train/updates_recomputed"] == 0  # (a non-finite loss is not cuDNN's: no retry)


def test_completion_logprobs_feed_no_column_past_the_completion(policy, mismatched):
    """The last completion token's logit would predict past the completion: the forward is fed one
    column less than the window (its logits come out contiguous), and every valid log-prob equals
    the one read off a full-width forward's logits."""
    r = mismatched
    input_ids, attention_mask = torch.cat([r.prompt_ids, r.completion_ids], 1), torch.cat([r.prompt_mask, r.completion_mask], 1)
    probe = QeRLModule(model="tiny-qwen2", quantization="nvfp4", dtype="fp32")
    probe.model = policy
    fed = []
    hook = policy.get_input_embeddings().register_forward_hook(lambda m, args, out: fed.append(args[0].shape))
    try:
        with torch.no_grad():
            got, _ = probe.completion_logprobs(input_ids, attention_mask, r.completion_ids, temperature=1.0)
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            logits = policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    finally:
        hook.remove()
    P = r.prompt_ids.shape[1]
    want = torch.log_softmax(logits[:, P - 1:-1].float(), -1).gather(-1, r.completion_ids[..., None])[..., 0]
    valid = r.completion_mask.bool()
    leading_padding = int((~attention_mask.bool()).all(0).long().cumprod(0).sum())   # columns cut on the left
    assert fed[0][1] == P + int(valid.sum(-1).max()) - 1 - leading_padding
    assert torch.allclose(got[valid], want[valid], atol=1e-5)


def test_logged_entropy_and_is_ratio_cover_every_sampled_token(policy, mismatched, tmp_path):
    """train/entropy and train/is_ratio/mean describe the samples, not the loss's tokens: with every
    completion truncated and ``mask_truncated`` no token trains (all-zero gradients), yet both are the
    values of the run without the mask, finite, not 0/0; the update's per-token means are NaN (no token)."""
    truncated = copy.deepcopy(mismatched)
    truncated.truncated[:] = True
    plain = fit(policy, truncated, tmp_path / "plain", mask_truncated=False)
    masked = fit(policy, truncated, tmp_path / "masked", mask_truncated=True)
    assert max_abs(masked.grads[0]) == 0.0
    for key in ("train/entropy", "train/is_ratio/mean"):
        assert math.isfinite(masked.logged[key]) and abs(masked.logged[key] - plain.logged[key]) <= 1e-6, key
    # the per-token means of the update (ratio, clip ratios) have no token to average: NaN, not 0
    for key in ("train/policy_ratio/mean", "train/clip_ratio/low", "train/clip_ratio/region"):
        assert math.isnan(masked.logged[key]) and math.isfinite(plain.logged[key]), key


def test_logged_scalars_equal_their_definitions(policy, mismatched, tmp_path):
    """The values, not only the presence, of the rollout-level curves, recomputed from the hand-made
    rollout: the sampler's log-probs are the trainer's + OFFSET, so the importance ratio is exp(-OFFSET)."""
    logged = fit(policy, mismatched, tmp_path / "run").logged
    valid = mismatched.completion_mask.bool()
    groups = REWARDS.view(-1, G)
    expected = {
        "train/reward": REWARDS.mean(),
        "train/reward_std": groups.std(-1).mean(),       # the mean within-group std, not the batch's
        "train/frac_reward_zero_std": 0.0,
        "train/completion_length/mean": LENGTHS.float().mean(),
        "train/completion_length/max": LENGTHS.max(),
        "train/clipped_ratio": (LENGTHS == T).float().mean(),
        "train/is_ratio/mean": torch.exp(-OFFSET)[valid].mean(),  # trainer / sampler, over every sampled token
    }
    for key, value in expected.items():
        assert logged[key] == pytest.approx(float(value), rel=1e-4, abs=1e-6), key


def test_is_ratio_leaves_out_non_finite_sampler_logprobs(policy, mismatched, tmp_path):
    """A NaN or -inf sampler log-prob: the logged mean ratio is over the other sampled tokens (one NaN
    made the whole step's curve NaN, one -inf added e^20)."""
    broken = copy.deepcopy(mismatched)
    valid = broken.completion_mask.bool()
    keep = valid.clone()
    for which, value in ((3, float("nan")), (5, float("-inf"))):  # (-inf gave e^20 after the clamp)
        row, col = valid.nonzero()[which].tolist()
        broken.sampler_logprobs[row, col] = value
        keep[row, col] = False
    logged = fit(policy, broken, tmp_path / "run").logged
    assert logged["train/is_ratio/mean"] == pytest.approx(float(torch.exp(-OFFSET)[keep].mean()), rel=1e-4)


def test_advantage_scale_reaches_the_update(policy, mismatched, tmp_path):
    """group / batch / none scale the same centred rewards differently: three different updates
    (the groups' stds differ, so no two agree after clipping is off)."""
    kw = dict(max_grad_norm=1e9, tis_cap=None)
    runs = {scale: fit(policy, mismatched, tmp_path / scale, advantage_scale=scale, **kw)
            for scale in ("group", "batch", "none")}
    for a, b in (("group", "batch"), ("group", "none"), ("batch", "none")):
        assert_different_update(runs[a], runs[b], f"{a} vs {b}")


def test_is_weights_use_the_rollout_time_log_probs_in_every_update(policy, mismatched, tmp_path, monkeypatch):
    """TIS corrects pi_old / pi_sampler: the trainer's log-probs at rollout time, the same in every one of
    the K updates (not the live policy's, which moves after the first optimizer step)."""
    import lightning_modules.qerl_module as qerl_module

    seen = []

    def spy(old, *args, **kwargs):
        seen.append(old.detach().clone())
        return weights(old, *args, **kwargs)

    weights = qerl_module.truncated_is_weights
    monkeypatch.setattr(qerl_module, "truncated_is_weights", spy)
    fit(policy, mismatched, tmp_path / "run", updates_per_rollout=2, micro_batch_size=8)
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])


def test_dr_grpo_divides_by_max_new_tokens_not_the_longest_completion(policy, mismatched, tmp_path):
    """Dr.GRPO's constant normaliser is N * max_new_tokens: the same completions under a limit twice
    as long give half the loss (whatever the padded width of the batch)."""
    longer = copy.deepcopy(mismatched)
    longer.max_new_tokens = 2 * T
    base = fit(policy, mismatched, tmp_path / "t", aggregation="dr_grpo", tis_cap=None).logged["train/loss"]
    half = fit(policy, longer, tmp_path / "2t", aggregation="dr_grpo", tis_cap=None).logged["train/loss"]
    assert base != 0 and half == pytest.approx(base / 2, rel=1e-5)


# ------------------------------------------------------------------------------------------------
# importance sampling against the sampler's log-probs


IS_VARIANTS = {
    "token/truncate": dict(tis_level="token", tis_mode="truncate"),
    "token/mask": dict(tis_level="token", tis_mode="mask"),
    "sequence/truncate": dict(tis_level="sequence", tis_mode="truncate"),
    "sequence/mask": dict(tis_level="sequence", tis_mode="mask"),
    "geometric/truncate": dict(tis_level="geometric", tis_mode="truncate"),
}


def test_importance_sampling_level_and_mode_each_change_the_update(policy, mismatched, tmp_path):
    cap = 2.0
    # the offsets put tokens and sequences on both sides of the cap, so truncate != mask at both levels
    valid = mismatched.completion_mask.bool()
    token_log_w = -OFFSET[valid]
    sequence_log_w = torch.where(valid, -OFFSET, 0.0).sum(-1)
    for log_w in (token_log_w, sequence_log_w):
        assert (log_w > math.log(cap)).any() and (log_w < math.log(cap)).any()

    # no gradient clipping here: it would rescale every variant to the same norm
    kw = dict(tis_cap=cap, max_grad_norm=1e9)
    plain = fit(policy, mismatched, tmp_path / "plain", tis_cap=None, max_grad_norm=1e9)  # no IS correction
    runs = {name: fit(policy, mismatched, tmp_path / name.replace("/", "_"), **kw, **variant)
            for name, variant in IS_VARIANTS.items()}
    runs["none"] = plain
    names = list(runs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert_different_update(runs[a], runs[b], f"{a} vs {b}")

    # control: when the sampler agrees with the trainer every weight is 1 and no variant changes the update
    matched = make_rollout(policy, torch.zeros(N, T))
    for name in ("token/mask", "sequence/truncate"):
        run = fit(policy, matched, tmp_path / f"matched_{name.replace('/', '_')}", **kw, **IS_VARIANTS[name])
        assert_same_update(run, plain, f"{name} with matched log-probs")


def test_entropy_bonus_changes_the_update_and_raises_entropy(policy, mismatched, tmp_path):
    """entropy_coef > 0 backpropagates through the token entropy: a different gradient, and after
    the update the policy's entropy on the rollout's completions is higher than without the bonus.
    The logged train/entropy is the pre-update value, the same for both runs."""
    kw = dict(max_grad_norm=1e9, tis_cap=None)
    plain = fit(policy, mismatched, tmp_path / "plain", **kw)
    bonus = fit(policy, mismatched, tmp_path / "bonus", entropy_coef=1.0, **kw)
    assert_different_update(plain, bonus, "entropy bonus")
    assert bonus.logged["train/entropy"] == pytest.approx(plain.logged["train/entropy"], rel=1e-5)

    def mean_entropy(run):
        r = mismatched
        with torch.no_grad():
            _, h = run.module.completion_logprobs(torch.cat([r.prompt_ids, r.completion_ids], 1),
                                                  torch.cat([r.prompt_mask, r.completion_mask], 1),
                                                  r.completion_ids, 1.0, with_entropy=True)
        return float((h * r.completion_mask).sum() / r.completion_mask.sum())
    h_bonus, h_plain = mean_entropy(bonus), mean_entropy(plain)
    assert h_bonus > h_plain + 0.005, (h_bonus, h_plain)       # measured: 4.544 vs 4.515 nats
    with pytest.raises(ValueError, match="entropy_coef"):
        LossSettings(entropy_coef=-0.1)


def test_sequence_ratio_gspo(policy, mismatched, tmp_path):
    """ratio_level: sequence (GSPO) equals token-level GRPO on the first, on-policy update and
    differs on the second, off-policy one."""
    kw = dict(updates_per_rollout=2, max_grad_norm=1e9, tis_cap=None)
    token = fit(policy, mismatched, tmp_path / "token", **kw)
    seq = fit(policy, mismatched, tmp_path / "seq", ratio_level="sequence", **kw)
    scale = max_abs(token.grads[0])
    assert max_diff(token.grads[0], seq.grads[0]) <= 1e-5 * scale
    assert max_diff(token.grads[1], seq.grads[1]) > 1e-3 * max_abs(token.grads[1])


def test_top_entropy_quantile_trains_on_the_forking_tokens_only(policy, mismatched, tmp_path):
    """top_entropy_quantile < 1 changes the update and 1.0 is the plain objective; the chosen tokens
    come from one pre-update pass over the whole rollout, so the update does not depend on the
    micro-batch size. (One update per rollout: at this test's large LR a second update finds every
    kept token clipped, a zero gradient that would make the comparison vacuous.)"""
    kw = dict(max_grad_norm=1e9, tis_cap=None)
    plain = fit(policy, mismatched, tmp_path / "plain", **kw)
    assert_same_update(fit(policy, mismatched, tmp_path / "all", top_entropy_quantile=1.0, **kw), plain, "quantile 1")
    top = fit(policy, mismatched, tmp_path / "top", top_entropy_quantile=0.3, micro_batch_size=8, **kw)
    assert_different_update(top, plain, "top 30% entropy tokens")
    small = fit(policy, mismatched, tmp_path / "small", top_entropy_quantile=0.3, micro_batch_size=3, **kw)
    assert_same_update(top, small, "top 30% with micro-batches of 8 and 3")
    # the logged entropy is the pre-update one over all tokens (from the selection pass, not recomputed)
    assert top.logged["train/entropy"] == pytest.approx(plain.logged["train/entropy"], rel=1e-5)
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        LossSettings(top_entropy_quantile=0.0)


def test_rollout_only_noise_stays_off_in_the_training_backward(policy, mismatched, tmp_path):
    """apply_to: rollout trains on the clean policy, with or without gradient checkpointing (which
    recomputes each layer's forward during backward: the noise must be off there too)."""
    kw = dict(max_grad_norm=1e9, tis_cap=None)
    clean = fit(policy, mismatched, tmp_path / "clean", **kw)
    noisy = fit(policy, mismatched, tmp_path / "noisy", rollout_noise=0.05, **kw)
    checkpointed = fit(policy, mismatched, tmp_path / "gc", rollout_noise=0.05,
                       module_kw=dict(gradient_checkpointing=True), **kw)
    assert_same_update(noisy, clean, "rollout-only noise")
    assert_same_update(checkpointed, clean, "rollout-only noise, gradient checkpointing")


def test_policy_ratio_is_one_on_policy_and_moves_with_later_updates(policy, mismatched, tmp_path):
    """train/policy_ratio/mean: pi / pi_old is exactly 1 in update 0 (on-policy, K = 1); with K = 2
    the second update runs on moved weights, so the step's mean leaves 1 (by a bounded amount)."""
    on_policy = fit(policy, mismatched, tmp_path / "k1", max_grad_norm=1e9)
    assert on_policy.logged["train/policy_ratio/mean"] == 1.0
    two = fit(policy, mismatched, tmp_path / "k2", max_grad_norm=1e9, updates_per_rollout=2)
    ratio = two.logged["train/policy_ratio/mean"]
    # (1.48 with this seed; 1.27 to 1.74 over other LoRA A draws at this LR: the bound catches a blow-up)
    assert ratio != 1.0 and abs(ratio - 1.0) < 1.0, ratio


def test_reference_pass_runs_without_noise_while_training_runs_with_it(policy, mismatched, tmp_path, monkeypatch):
    """apply_to: both keeps the noise on for the training forwards, never for the KL reference: the
    reference log-probs of a noisy run equal a noise-free run's (the frozen base, LoRA off), while
    the policy's log-probs differ."""
    import lightning_modules.qerl_module as qm

    seen = []

    def spy(logprobs, old, *args, ref_logprobs=None, **kwargs):
        seen.append((logprobs.detach().clone(), ref_logprobs.clone()))
        return real(logprobs, old, *args, ref_logprobs=ref_logprobs, **kwargs)

    real = qm.policy_loss
    monkeypatch.setattr(qm, "policy_loss", spy)
    kw = dict(kl_coef=0.1, tis_cap=None)
    fit(policy, mismatched, tmp_path / "clean", **kw)
    clean, seen[:] = list(seen), []
    fit(policy, mismatched, tmp_path / "noisy", rollout_noise=0.05, noise_apply_to="both", **kw)
    assert len(seen) == len(clean) > 0
    for (noisy_lp, noisy_ref), (clean_lp, clean_ref) in zip(seen, clean):
        torch.testing.assert_close(noisy_ref, clean_ref, rtol=0, atol=1e-6)   # reference: noise off
        assert (noisy_lp - clean_lp).abs().max() > 1e-3                      # training: noise on


@pytest.mark.parametrize("bad", [dict(lr=-1e-3), dict(lr=0.0), dict(max_grad_norm=-1.0), dict(warmup_ratio=2.0),
                                 dict(weight_decay=-0.1)])
def test_bad_optimizer_settings_fail_at_construction(bad):
    """Before the model loads (a negative max_grad_norm would silently flip every gradient)."""
    with pytest.raises(ValueError, match="model.optimizer"):
        OptimizerSettings(**bad)


@pytest.mark.parametrize("bad", [dict(samples=-1), dict(top_p=1.5), dict(temperature=-1.0), dict(max_new_tokens=0),
                                 dict(samples=2, pass_k=[4])])
def test_bad_eval_settings_fail_at_construction(bad):
    from lightning_modules.evaluation import EvalSettings

    with pytest.raises(ValueError):
        EvalSettings(**bad)


@pytest.mark.parametrize("bad", [dict(aggregation="dapo2"), dict(tis_level="seq"), dict(tis_mode="clip"),
                                 dict(ratio_level="tokens"), dict(advantage_scale="std")])
def test_bad_loss_choices_fail_at_construction(bad):
    """Settings built in code get the choices the CLI checks (a bad tis_level with tis_cap null
    would otherwise never fail)."""
    with pytest.raises(ValueError, match=f"model.loss.{next(iter(bad))} must be one of"):
        LossSettings(**bad, tis_cap=None)


def test_lora_dropout_is_validated_and_warned_about():
    from qerl.model import LoraSettings

    with pytest.raises(ValueError, match=r"lora.dropout must be in \[0, 1\)"):
        LoraSettings(dropout=1.5)
    module = QeRLModule(model="tiny-qwen2", quantization="nvfp4", dtype="fp32", lora=LoraSettings(rank=4, dropout=0.1))
    with pytest.warns(UserWarning, match="lora.dropout = 0.1: each training forward draws its own dropout mask"):
        module.configure_model()


def test_lr_factor_by_hand():
    """Warmup (s+1)/(w+1) from step 0 (never 0), then cosine / linear / constant over the rest; the
    warmup length is ratio x steps exactly, also where the float product falls just below it."""
    from lightning_modules.settings import lr_factor

    # 10 steps, 20% warmup: steps 0, 1 warm up to 1/3, 2/3; then 8 steps of decay
    assert [lr_factor(s, 10, 0.2, "constant") for s in range(4)] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])
    assert lr_factor(2, 10, 0.2, "cosine") == 1.0
    assert lr_factor(6, 10, 0.2, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 8)))
    assert lr_factor(6, 10, 0.2, "linear") == pytest.approx(0.5)
    assert lr_factor(9, 10, 0.0, "linear") == pytest.approx(0.1)
    # 0.29 * 100 is 28.999999999999996 in floats: still 29 warmup steps (28 before the fix)
    assert lr_factor(28, 100, 0.29, "cosine") == pytest.approx(29 / 30)
    assert lr_factor(29, 100, 0.29, "cosine") == 1.0
    assert lr_factor(2, 20, 0.1, "cosine") == 1.0  # 0.1 * 20 = 2.0000000000000004: 2 steps, not 3
    # warmup over the whole run: the ramp ends below the peak, and a step past the end stays at the schedule's end
    assert lr_factor(9, 10, 1.0, "cosine") == pytest.approx(10 / 11)
    assert lr_factor(10, 10, 1.0, "cosine") == pytest.approx(0.0)
    assert lr_factor(10, 10, 1.0, "constant") == 1.0


_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize("bad", [dict(lr=_NAN), dict(lr=_INF), dict(lr=1e40), dict(weight_decay=_NAN),
                                 dict(weight_decay=_INF), dict(betas=(_NAN, 0.99)), dict(betas=(0.9, 1.0)),
                                 dict(warmup_ratio=_NAN), dict(max_grad_norm=_INF), dict(max_grad_norm=_NAN)],
                         ids=lambda bad: f"{next(iter(bad))}={next(iter(bad.values()))}")
def test_non_finite_optimizer_settings_fail_at_construction(bad):
    """`lr > 0` holds for inf and `weight_decay < 0` fails for NaN: an AdamW overflow at the first step,
    or NaN weights written into checkpoints. Each is one line naming its key."""
    with pytest.raises(ValueError, match=f"model.optimizer.{next(iter(bad))} must be"):
        OptimizerSettings(**bad)


@pytest.mark.parametrize("key", ["clip_low", "clip_high", "kl_coef", "entropy_coef", "tis_cap", "top_entropy_quantile",
                                 "dual_clip"])
@pytest.mark.parametrize("value", [_NAN, _INF])
def test_non_finite_loss_settings_fail_at_construction(key, value):
    """A NaN kl_coef passed `kl_coef < 0` and dropped the KL term silently. An infinite clip or IS cap
    means "unclipped" (accepted, as before); an infinite coefficient or quantile has no meaning."""
    if value == _INF and key in ("clip_low", "clip_high", "tis_cap"):
        assert getattr(LossSettings(**{key: value}), key) == _INF
        return
    with pytest.raises(ValueError, match=f"model.loss.{key} must be"):
        LossSettings(**{key: value})


def test_an_unknown_kl_estimator_is_refused():
    with pytest.raises(ValueError, match="model.loss.kl_estimator must be one of k1, k2, k3"):
        LossSettings(kl_estimator="k4")


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="model.loss.dual_clip must be > 1"):
        LossSettings(dual_clip=1.0)
    assert LossSettings(dual_clip=3.0).dual_clip == 3.0


@pytest.mark.parametrize("bad", [dict(temperature=_NAN), dict(temperature=_INF), dict(top_p=_NAN), dict(top_k=-1),
                                 dict(max_new_tokens=0), dict(min_p=_NAN), dict(min_p=1.5), dict(min_p=-0.1),
                                 dict(temperature=1e-40)],
                         ids=lambda bad: f"{next(iter(bad))}={next(iter(bad.values()))}")
def test_bad_sampling_settings_name_their_key(bad):
    """A NaN temperature passed `temperature < 0` and ended in torch.multinomial at the first rollout."""
    from qerl.rollout import SamplingSettings

    with pytest.raises(ValueError, match=f"sampling.{next(iter(bad))} must be"):
        SamplingSettings(**bad)


def load_benchmark(name: str):
    """A script of benchmarks/ as a module."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _NaNGradWhereNothingIsSeen(torch.autograd.Function):
    """Identity on the queries whose backward writes NaN into the rows that see no key: what SDPA's
    cuDNN backend did on the H200 at some shapes (qerl/attention_masks.py)."""

    @staticmethod
    def forward(ctx, query, blind):
        ctx.save_for_backward(blind)
        return query.clone()

    @staticmethod
    def backward(ctx, grad):
        (blind,) = ctx.saved_tensors
        return grad.masked_fill(blind, float("nan")), None


def test_padding_queries_see_themselves_so_attention_backward_stays_finite(policy, mismatched, tmp_path, monkeypatch):
    """Row 0's prompt is left-padded: with transformers' own mask its padding queries see nothing,
    and an attention backward like cuDNN's (NaN dq there) loses the update; the trainer's explicit
    mask lets them see themselves, and the update is applied."""
    import lightning_modules.policy_forward as policy_forward

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def cudnn_like(query, key, value, attn_mask=None, **kw):
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            query = _NaNGradWhereNothingIsSeen.apply(query, ~attn_mask.any(-1, keepdim=True))
        return sdpa(query, key, value, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", cudnn_like)
    applied = fit(policy, mismatched, tmp_path / "explicit")
    assert all(torch.isfinite(g).all() for g in applied.grads[0])
    assert max_diff(applied.before, applied.after) > 0.5 * LR

    monkeypatch.setattr(policy_forward, "left_padding_mask", lambda model, attention_mask: attention_mask)
    hunt = load_benchmark("nonfinite_hunt").Hunt()

    class Watched(QeRLModule):
        pass

    uninstall = hunt.install(Watched)
    try:
        with pytest.warns(UserWarning, match=r"non-finite gradient norm \(\d+ of \d+ gradients, first \S+lora_") as seen:
            lost = fit(policy, mismatched, tmp_path / "two_d", module_class=Watched)
    finally:
        uninstall()
    assert max_diff(lost.before, lost.after) == 0.0
    # the count is of the gradients the backward broke, not of all: the last layer's o_proj and MLP
    # adapters sit above the failing attention and stay finite (none are NaN-ed by a clip factor)
    named = next(m for w in seen if (m := re.search(r"\((\d+) of (\d+) gradients", str(w.message))))
    bad, total = map(int, named.groups())
    assert 0 < bad < total
    # benchmarks/nonfinite_hunt.py names where the backward broke: the last layer's attention, whose
    # query projection's output gradient is the first non-finite one; the forward stayed finite
    assert not [f for f in hunt.findings if f["kind"] == "forward"]
    first = [f for f in hunt.findings if f["kind"] == "first_output_gradient"][0]
    assert first["module"].endswith("layers.1.self_attn.q_proj"), first
    assert [f for f in hunt.findings if f["kind"] == "parameter_gradients"][0]["non_finite"] > 0


def test_update_with_non_finite_cudnn_gradients_is_recomputed_without_cudnn(policy, mismatched, tmp_path, monkeypatch):
    """An attention whose backward gives NaN only while SDPA may pick cuDNN (as on the H200, even
    with the explicit mask): the update is recomputed without cuDNN attention and applied -- the
    same update as a run whose attention never failed -- instead of skipped; the retry's passes,
    checkpoint recompute included, ran with cuDNN off, and it is back on after."""
    import lightning_modules.policy_forward as policy_forward
    import lightning_modules.qerl_module as qerl_module

    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []  # per attention call: was cuDNN allowed?

    def cudnn_only_bug(query, key, value, attn_mask=None, **kw):
        calls.append(torch.backends.cuda.cudnn_sdp_enabled())
        if calls[-1] and attn_mask is not None and attn_mask.dtype == torch.bool:
            query = _NaNGradWhereNothingIsSeen.apply(query, ~attn_mask.any(-1, keepdim=True))
        return sdpa(query, key, value, attn_mask=attn_mask, **kw)

    healthy = fit(policy, mismatched, tmp_path / "healthy", updates_per_rollout=2,
                  module_kw=dict(gradient_checkpointing=True))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", cudnn_only_bug)
    monkeypatch.setattr(policy_forward, "left_padding_mask", lambda model, attention_mask: attention_mask)
    monkeypatch.setattr(qerl_module, "cudnn_attention_enabled", lambda device: torch.backends.cuda.cudnn_sdp_enabled())
    with pytest.warns(UserWarning, match=r"non-finite gradient norm at step 0 \(cuDNN attention on.*recomputing") as seen:
        recovered = fit(policy, mismatched, tmp_path / "recovered", updates_per_rollout=2,
                        module_kw=dict(gradient_checkpointing=True))
    assert not [w for w in seen if "skipping this update" in str(w.message)]
    assert len([w for w in seen if "recomputing" in str(w.message)]) == 1
    assert recovered.steps_per_batch == [2] and len(recovered.grads) == 2
    assert_same_update(healthy, recovered, "recomputed without cuDNN")
    assert recovered.logged["train/loss"] == pytest.approx(healthy.logged["train/loss"], rel=1e-5)
    # update 0 failed with cuDNN and was recomputed; update 1 ran without cuDNN from the start (the
    # run stays off it): visible in TensorBoard, none skipped
    assert recovered.logged["train/updates_recomputed"] == 1 and recovered.logged["train/updates_skipped"] == 0
    assert healthy.logged["train/updates_recomputed"] == 0
    assert True in calls and False in calls and torch.backends.cuda.cudnn_sdp_enabled()
    first_off = calls.index(False)  # after the first failure no pass allowed cuDNN again
    assert not any(calls[first_off:]) and recovered.module._cudnn_failed

    calls.clear()  # model.cudnn_attention: false keeps cuDNN out of every pass: nothing to recompute
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        without = fit(policy, mismatched, tmp_path / "without", updates_per_rollout=2,
                      module_kw=dict(gradient_checkpointing=True, cudnn_attention=False))
    assert calls and not any(calls) and torch.backends.cuda.cudnn_sdp_enabled()
    assert not [w for w in seen if "non-finite" in str(w.message)]
    assert_same_update(healthy, without, "cudnn_attention false")


def test_after_the_switch_off_no_update_is_recomputed_again_and_a_resume_stays_off(policy, mismatched, tmp_path, monkeypatch):
    """Update 0 fails only with cuDNN (recomputed without it); update 1 fails whatever the backend:
    it is skipped, not recomputed "without cuDNN" a second time. The switch-off is in the
    checkpoint: a run resumed from it trains without cuDNN attention too."""
    import lightning_modules.policy_forward as policy_forward
    import lightning_modules.qerl_module as qerl_module

    sdpa = torch.nn.functional.scaled_dot_product_attention
    state = {"fail_always": False}

    def bug(query, key, value, attn_mask=None, **kw):
        if (torch.backends.cuda.cudnn_sdp_enabled() or state["fail_always"]) and attn_mask is not None \
                and attn_mask.dtype == torch.bool:
            query = _NaNGradWhereNothingIsSeen.apply(query, ~attn_mask.any(-1, keepdim=True))
        return sdpa(query, key, value, attn_mask=attn_mask, **kw)

    check = QeRLModule.check_weights_finite

    def after_an_applied_update(self):  # (runs after each optimizer step)
        state["fail_always"] = True
        return check(self)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", bug)
    monkeypatch.setattr(policy_forward, "left_padding_mask", lambda model, attention_mask: attention_mask)
    monkeypatch.setattr(qerl_module, "cudnn_attention_enabled", lambda device: torch.backends.cuda.cudnn_sdp_enabled())
    monkeypatch.setattr(QeRLModule, "check_weights_finite", after_an_applied_update)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run = fit(policy, mismatched, tmp_path / "twice", updates_per_rollout=2)
    assert len([w for w in seen if "recomputing" in str(w.message)]) == 1
    assert len([w for w in seen if "skipping this update" in str(w.message)]) == 1
    assert run.logged["train/updates_recomputed"] == 1 and run.logged["train/updates_skipped"] == 1

    path = tmp_path / "off.ckpt"
    run.trainer.save_checkpoint(path)
    resumed = QeRLModule(model="tiny-qwen2", quantization="nvfp4", dtype="fp32")
    resumed.model = run.module.model
    assert not resumed._cudnn_failed
    resumed.on_load_checkpoint(torch.load(path, weights_only=False))
    assert resumed._cudnn_failed


def test_gradients_are_clipped_to_max_grad_norm_and_the_norm_before_is_logged(policy, mismatched, tmp_path):
    run = fit(policy, mismatched, tmp_path / "clip", max_grad_norm=1e-3)
    applied = torch.cat([g.flatten() for g in run.grads[0]]).norm()
    assert run.logged["train/grad_norm"] > 1e-2  # the norm before clipping, far above the cap
    assert applied == pytest.approx(1e-3, rel=1e-4)  # what the optimizer stepped with
