"""RolloutCallback (dynamic sampling, overlong shaping, noisy-norm sync) and AQNCallback wiring."""

from types import SimpleNamespace

import pytest
import torch

from callbacks import AQNCallback, RolloutCallback
from lightning_modules.qerl_module import QeRLModule
from qerl.aqn import ConstantNoise
from qerl.rewards import MathAccuracy, RewardFunction
from qerl.rollout import Generation, RolloutEngine, SamplingSettings


class ScriptedEngine(RolloutEngine):
    """Returns completions chosen per prompt by a script; records what sync received."""

    def __init__(self, script):
        self.script, self.synced = script, []

    def sync(self, model, norm_scales=None):
        self.synced.append(norm_scales)

    def generate(self, prompt_ids, n, sampling, seed):
        ids = [list(self.script[tuple(p)][i]) for p in prompt_ids for i in range(n)]
        return Generation(ids, [[-1.0] * len(c) for c in ids], ["stop"] * len(ids))


class CharIsA(RewardFunction):
    name = "is_a"

    def compute(self, completions, answers):
        return [1.0 if c.startswith("a") else 0.0 for c in completions]


def _module(tmp=None):
    module = QeRLModule(model="tiny-qwen2", quantization="nvfp4", dtype="fp32")
    module.configure_model()
    return module


def _trainer(callbacks, extra_prompts=None, step=0):
    dm = SimpleNamespace(draw_extra=lambda n, seed, exclude: extra_prompts) if extra_prompts else None
    return SimpleNamespace(global_step=step, callbacks=callbacks, datamodule=dm, loggers=[], is_global_zero=True,
                           max_steps=10)


def test_dynamic_sampling_drops_flat_groups_and_refills():
    module = _module()
    tok = module.tokenizer
    enc = lambda s: tok(s)["input_ids"]  # noqa: E731
    p_flat, p_mixed, p_extra = enc("x"), enc("y"), enc("z")
    script = {tuple(p_flat): [enc("b"), enc("b")], tuple(p_mixed): [enc("a"), enc("b")],
              tuple(p_extra): [enc("b"), enc("a")]}
    cb = RolloutCallback(reward=CharIsA(), group_size=2, sampling=SamplingSettings(max_new_tokens=4),
                         dynamic_sampling=True, max_refill_rounds=2)
    cb.engine = ScriptedEngine(script)
    extra = {"prompt_ids": [p_extra], "prompts": ["z"], "answers": ["-"], "sources": ["refill.jsonl"]}
    batch = {"prompt_ids": [p_flat, p_mixed], "prompts": ["x", "y"], "answers": ["-", "-"], "sources": ["a", "b"]}
    cb.on_train_batch_start(_trainer([cb], extra), module, batch, 0)
    rollout = batch["rollout"]
    assert rollout.prompts == ["y", "y", "z", "z"]  # the flat group is gone, one refill took its place
    assert rollout.sources == ["b", "b", "refill.jsonl", "refill.jsonl"]  # each row keeps its prompt's set
    assert rollout.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert rollout.num_groups_dropped == 1
    assert rollout.completion_mask.sum().item() == 4
    assert abs(rollout.sampled_reward - 2 / 6) < 1e-6  # every generated group, the dropped flat one too

    # the adaptive AQN controller watches that reward, not the kept groups' (near 0.5 by construction)
    aqn = AQNCallback(controller=ConstantNoise(sigma=0.0))
    aqn.on_train_batch_end(SimpleNamespace(world_size=1, callback_metrics={}), module, None, batch, 0)
    assert aqn.monitor.rewards == [rollout.sampled_reward]


def test_sampler_and_trainer_agree_at_a_temperature_below_one():
    """End to end at T = 0.7: the embedded engine samples from softmax(logits / T), the Rollout carries
    T, and the trainer's log-probs of the same tokens (log softmax(logits / T)) equal the sampler's."""
    module = _module()
    tok = module.tokenizer
    cb = RolloutCallback(reward=CharIsA(), group_size=3, sampling=SamplingSettings(temperature=0.7, max_new_tokens=6))
    cb.engine = cb.make_engine(module)
    prompts = [tok("x y")["input_ids"], tok("z")["input_ids"]]
    batch = {"prompt_ids": prompts, "prompts": ["x y", "z"], "answers": ["-", "-"]}
    cb.on_train_batch_start(_trainer([cb]), module, batch, 0)
    r = batch["rollout"]
    assert r.temperature == 0.7
    with torch.no_grad():
        trainer_lp, _ = module.completion_logprobs(torch.cat([r.prompt_ids, r.completion_ids], 1),
                                                   torch.cat([r.prompt_mask, r.completion_mask], 1),
                                                   r.completion_ids, temperature=r.temperature)
    valid = r.completion_mask.bool()
    torch.testing.assert_close(trainer_lp[valid], r.sampler_logprobs[valid], rtol=0, atol=1e-4)
    at_one, _ = module.completion_logprobs(torch.cat([r.prompt_ids, r.completion_ids], 1),
                                           torch.cat([r.prompt_mask, r.completion_mask], 1), r.completion_ids,
                                           temperature=1.0)
    assert (at_one[valid] - r.sampler_logprobs[valid]).abs().max() > 1e-2  # (T matters on this model)


def _scripted_dynamic_sampling(script_text: dict[str, list[str]], max_refill_rounds: int):
    """A tiny module and a RolloutCallback with dynamic sampling over a ScriptedEngine whose prompt ->
    completions script is given as text; returns (module, encode, callback)."""
    module = _module()
    enc = lambda s: module.tokenizer(s)["input_ids"]  # noqa: E731
    cb = RolloutCallback(reward=CharIsA(), group_size=2, sampling=SamplingSettings(max_new_tokens=4),
                         dynamic_sampling=True, max_refill_rounds=max_refill_rounds)
    cb.engine = ScriptedEngine({tuple(enc(p)): [enc(c) for c in cs] for p, cs in script_text.items()})
    return module, enc, cb


def test_dynamic_sampling_with_no_signal_anywhere_trains_the_original_batch():
    """Early in training every group can be flat: then the batch trains as drawn (advantages 0), with
    nothing counted as dropped, rather than an empty rollout."""
    module, enc, cb = _scripted_dynamic_sampling({"x": ["b", "b"], "y": ["a", "a"]}, max_refill_rounds=0)
    batch = {"prompt_ids": [enc("x"), enc("y")], "prompts": ["x", "y"], "answers": ["-", "-"]}
    cb.on_train_batch_start(_trainer([cb]), module, batch, 0)
    assert batch["rollout"].prompts == ["x", "x", "y", "y"] and batch["rollout"].num_groups_dropped == 0
    assert batch["rollout"].rewards.tolist() == [0.0, 0.0, 1.0, 1.0]


def test_refill_rounds_draw_fresh_prompts_per_step_and_round():
    module, enc, cb = _scripted_dynamic_sampling({"x": ["b", "b"], "z": ["b", "b"]}, max_refill_rounds=2)
    seeds = []
    extra = {"prompt_ids": [enc("z")], "prompts": ["z"], "answers": ["-"]}
    for step in (0, 1):
        trainer = _trainer([cb], extra, step=step)
        trainer.datamodule.draw_extra = lambda n, seed, exclude: seeds.append(seed) or extra
        cb.on_train_batch_start(trainer, module, {"prompt_ids": [enc("x")], "prompts": ["x"], "answers": ["-"]}, 0)
    assert len(seeds) == 4 and len(set(seeds)) == 4  # two rounds at each of two steps, each its own draw


def _excluded_by_refills(max_refill_rounds: int) -> list[set]:
    """What each refill round of one step (prompt x, then refills of z, all groups flat) passes over."""
    module, enc, cb = _scripted_dynamic_sampling({"x": ["b", "b"], "z": ["b", "b"]}, max_refill_rounds=max_refill_rounds)
    excluded = []
    extra = {"prompt_ids": [enc("z")], "prompts": ["z"], "answers": ["-"], "sources": ["s"], "indices": [7]}
    trainer = _trainer([cb], extra)
    trainer.datamodule.draw_extra = lambda n, seed, exclude: excluded.append(set(exclude)) or extra
    batch = {"prompt_ids": [enc("x")], "prompts": ["x"], "answers": ["-"], "sources": ["s"], "indices": [3]}
    cb.on_train_batch_start(trainer, module, batch, 0)
    return excluded


def test_refills_exclude_the_steps_prompts_and_earlier_refills():
    assert _excluded_by_refills(2) == [{("s", 3)}, {("s", 3), ("s", 7)}]  # the batch's, then also the first refill's


def test_refills_exclude_every_ranks_prompts_of_the_step(monkeypatch):
    """Under DDP the step is every rank's batch: what the other ranks drew is passed over too."""
    import callbacks.rollout as rollout_module

    monkeypatch.setattr(rollout_module, "every_rank_items", lambda trainer, items: [*items, ("s", 5)])
    assert _excluded_by_refills(1) == [{("s", 3), ("s", 5)}]


def test_dynamic_sampling_counts_a_refills_surplus_as_dropped():
    """A refill draws a whole batch of prompts: mixed groups beyond the batch are generated but not
    trained on, and ``train/groups_dropped`` says so."""
    module, enc, cb = _scripted_dynamic_sampling({"x": ["b", "b"], "y": ["a", "b"], "z": ["b", "a"], "w": ["a", "b"]},
                                                 max_refill_rounds=1)
    p_flat, p_mixed, p_extra, p_extra2 = enc("x"), enc("y"), enc("z"), enc("w")
    extra = {"prompt_ids": [p_extra, p_extra2], "prompts": ["z", "w"], "answers": ["-", "-"]}
    batch = {"prompt_ids": [p_flat, p_mixed], "prompts": ["x", "y"], "answers": ["-", "-"]}
    cb.on_train_batch_start(_trainer([cb], extra), module, batch, 0)
    assert batch["rollout"].prompts == ["y", "y", "z", "z"]
    assert batch["rollout"].num_groups_dropped == 2  # the flat group and the surplus "w"
    assert len(batch["rollout"].sampled_lengths()) == 8  # every generated completion stays in view


def test_dynamic_sampling_ignores_length_shaping():
    """DAPO filters on accuracy: a group all right (or all wrong) is dropped even when the overlong
    penalty makes its shaped rewards differ."""
    module = _module()
    tok = module.tokenizer
    enc = lambda s: tok(s)["input_ids"]  # noqa: E731
    p_flat, p_mixed = enc("x"), enc("y")
    script = {tuple(p_flat): [enc("a"), enc("abcd")], tuple(p_mixed): [enc("a"), enc("b")]}
    cb = RolloutCallback(reward=CharIsA(), group_size=2, sampling=SamplingSettings(max_new_tokens=4),
                         dynamic_sampling=True, max_refill_rounds=0, overlong_buffer=4)
    cb.engine = ScriptedEngine(script)
    batch = {"prompt_ids": [p_flat, p_mixed], "prompts": ["x", "y"], "answers": ["-", "-"]}
    cb.on_train_batch_start(_trainer([cb]), module, batch, 0)
    assert batch["rollout"].prompts == ["y", "y"] and batch["rollout"].num_groups_dropped == 1


def test_dynamic_sampling_keeps_the_truncation_of_dropped_groups_in_view():
    """A group whose completions all hit max_new_tokens scores all-equal and is dropped: the clipped
    ratio and lengths (and the truncation warning) still count it, over every generated completion."""
    module = _module()
    tok = module.tokenizer
    enc = lambda s: tok(s)["input_ids"]  # noqa: E731
    p_long, p_mixed = enc("x"), enc("y")
    script = {tuple(p_long): [enc("bbbb"), enc("bbbb")], tuple(p_mixed): [enc("a"), enc("b")]}

    class Truncating(ScriptedEngine):
        def generate(self, prompt_ids, n, sampling, seed):
            gen = super().generate(prompt_ids, n, sampling, seed)
            gen.finish_reasons = ["length" if len(c) >= 4 else "stop" for c in gen.completion_ids]
            return gen
    cb = RolloutCallback(reward=CharIsA(), group_size=2, sampling=SamplingSettings(max_new_tokens=4),
                         dynamic_sampling=True, max_refill_rounds=0)
    cb.engine = Truncating(script)
    batch = {"prompt_ids": [p_long, p_mixed], "prompts": ["x", "y"], "answers": ["-", "-"]}
    cb.on_train_batch_start(_trainer([cb]), module, batch, 0)
    r = batch["rollout"]
    assert r.prompts == ["y", "y"] and not r.truncated.any()                 # the kept rows: none truncated
    assert sorted(r.sampled_truncated().tolist()) == [False, False, True, True]   # what was generated
    assert sorted(r.sampled_lengths().tolist()) == [1, 1, 4, 4]


def test_overlong_shaping_adds_penalty_component():
    module = _module()
    tok = module.tokenizer
    p = tok("q")["input_ids"]
    cb = RolloutCallback(reward=CharIsA(), group_size=2, sampling=SamplingSettings(max_new_tokens=4),
                         overlong_buffer=4, overlong_penalty=1.0)
    cb.engine = ScriptedEngine({tuple(p): [tok("a")["input_ids"], tok("abcd")["input_ids"]]})
    batch = {"prompt_ids": [p], "prompts": ["q"], "answers": ["-"]}
    cb.on_train_batch_start(_trainer([cb]), module, batch, 0)
    r = batch["rollout"]
    assert r.reward_components["overlong"].tolist() == [-0.25, -1.0]  # 1 of 4 and 4 of 4 tokens
    assert r.rewards.tolist() == [0.75, 0.0]  # both start with "a": 1 + penalty
    assert r.sampled_reward == 1.0  # the accuracy curve (and the AQN monitor) leaves the length shaping out


def test_aqn_callback_sets_sigma_before_rollout_and_engine_gets_noisy_scales():
    module = _module()
    aqn = AQNCallback(controller=ConstantNoise(0.05), apply_to="rollout", seed=3)
    logged = {}
    module.log_dict = lambda d, **kw: logged.update(d)
    tok = module.tokenizer
    p = tok("q")["input_ids"]
    cb = RolloutCallback(reward=CharIsA(), group_size=2, sampling=SamplingSettings(max_new_tokens=4))
    cb.engine = ScriptedEngine({tuple(p): [tok("a")["input_ids"], tok("b")["input_ids"]]})
    trainer = _trainer([cb, aqn], step=5)  # AQN listed after the rollout: order must not matter
    aqn.on_fit_start(trainer, module)
    cb.on_train_batch_start(trainer, module, {"prompt_ids": [p], "prompts": ["q"], "answers": ["-"]}, 0)
    assert logged["aqn/sigma"] == 0.05 and logged["aqn/fraction_changed"] == 1.0
    scales = cb.engine.synced[-1]
    assert set(scales) == set(module.noisy_norms.names) and len(scales) == 2 * 2  # 2 layers x 2 norms
    for name, scale in scales.items():
        weight = dict(module.model.named_modules())[name].weight.float()
        assert not torch.equal(scale, weight)
        assert 0.02 < (scale - weight).std().item() < 0.08  # sigma = 0.05
    # apply_to: rollout -> the training forwards run clean
    assert module.noisy_norms.active
    with module._training_noise():
        assert not module.noisy_norms.active
    # the same (seed, step) after a "resume" gives the same noise
    fresh = _module()
    aqn2 = AQNCallback(controller=ConstantNoise(0.05), seed=3)
    fresh.log_dict = lambda d, **kw: None
    aqn2.on_fit_start(trainer, fresh)
    aqn2.prepare_step(trainer, fresh)
    again = fresh.noisy_norms.effective_scales()
    assert all(torch.equal(again[k], scales[k]) for k in scales)


class Parity(RewardFunction):
    name = "parity"

    def __init__(self):
        super().__init__()
        self.calls = 0

    def compute(self, completions, answers):
        self.calls += 1
        return [float(len(c) % 2) for c in completions]


def test_nan_loss_skips_the_update_and_loses_nothing(tmp_path, monkeypatch):
    import lightning as L
    import pytest

    import lightning_modules.qerl_module as qerl_module
    from lightning_modules.data import PromptDataModule

    calls = []

    def nan_first_batch(*args, **kwargs):  # a loss that blows up on the first rollout batch only
        loss, metrics = policy_loss(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan"), metrics) if len(calls) == 1 else (loss, metrics)

    policy_loss = qerl_module.policy_loss
    monkeypatch.setattr(qerl_module, "policy_loss", nan_first_batch)
    module = QeRLModule(model="tiny-qwen2", quantization="nvfp4", dtype="fp32")
    module.configure_model()
    lora_before = {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}
    cb = RolloutCallback(reward=Parity(), group_size=2, sampling=SamplingSettings(max_new_tokens=4))
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, callbacks=[cb], default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="non-finite loss at step 0: skipping this update"):
        trainer.fit(module, PromptDataModule(prompts_per_step=2))
    # the NaN batch's update slot counts (global_step stays a multiple of updates_per_rollout per
    # batch, or no checkpoint interval would be met again); the second batch made the real update
    assert trainer.global_step == 2 and cb.reward.calls == 2
    assert module.lr_schedulers().last_epoch == 2
    for n, p in module.model.named_parameters():
        if p.requires_grad:
            assert torch.isfinite(p).all(), n
    assert any(not torch.equal(p, lora_before[n]) for n, p in module.model.named_parameters() if p.requires_grad)


def test_generation_seed_differs_per_rank_and_keeps_rank_0():
    """Under DDP each rank samples its own random stream (one shared seed would correlate the
    ranks' samples); rank 0's seed is the single-process one, so one-GPU runs are unchanged."""
    from callbacks.rollout import generation_seed
    assert generation_seed(7, 3, 1) == (7 * 1_000_003 + 3) * 16 + 1 == generation_seed(7, 3, 1, rank=0)
    seeds = {generation_seed(s, step, r, rank) for s in (0, 1) for step in range(50) for r in range(16) for rank in range(8)}
    assert len(seeds) == 2 * 50 * 16 * 8                       # no two (seed, step, round, rank) collide


def test_per_n_step_events_fire_once_per_n_optimizer_steps_whatever_updates_per_rollout():
    from callbacks.rollout import batch_reaches_multiple

    for k in (1, 2, 3, 4):
        starts = range(0, 400, k)  # the optimizer step each rollout batch starts at
        fired = [s for s in starts if batch_reaches_multiple(s, k, 50)]
        multiples = range(0, starts[-1] + k, 50)  # every multiple of 50 the run's steps reach
        # one batch per multiple: the one whose steps s .. s + k - 1 include it
        assert len(fired) == len(multiples), (k, fired)
        assert all(s <= m < s + k for s, m in zip(fired, multiples)), (k, fired)
    assert [s for s in range(0, 20) if batch_reaches_multiple(s, 1, 5)] == [0, 5, 10, 15]


def test_checkpoint_interval_or_max_steps_not_a_multiple_of_updates_per_rollout_warns():
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_modules.settings import step_count_warnings

    cbs = [ModelCheckpoint(every_n_train_steps=50), ModelCheckpoint(every_n_train_steps=100), ModelCheckpoint()]
    (msg,) = step_count_warnings(cbs, updates_per_rollout=4, max_steps=200)
    assert "every_n_train_steps=50" in msg and "every 100 optimizer steps" in msg
    assert step_count_warnings(cbs, updates_per_rollout=2, max_steps=200) == []
    assert step_count_warnings(cbs, updates_per_rollout=1, max_steps=201) == []
    (msg,) = step_count_warnings([], updates_per_rollout=4, max_steps=201)
    assert "max_steps=201" in msg and "step 204" in msg and "3 update(s)" in msg


def test_group_of_one_or_bad_batch_settings_fail_at_construction():
    import pytest

    with pytest.raises(ValueError, match="group_size must be >= 2 .* got 1"):
        RolloutCallback(group_size=1)  # every advantage would be 0: only a KL term would train
    with pytest.raises(ValueError, match="max_batch_size must be >= 1 and max_refill_rounds in 0..15, got 0 and 2"):
        RolloutCallback(max_batch_size=0)
    for bad in (float("nan"), float("inf"), -5.0):  # NaN skipped every update; a negative one pays for length
        with pytest.raises(ValueError, match="overlong_penalty must be >= 0 and finite"):
            RolloutCallback(overlong_penalty=bad)
    for bad in ({"num_completions_to_log": -1}, {"log_completions_every_n_steps": -1}):  # a header only / never
        with pytest.raises(ValueError, match="log_completions_every_n_steps and num_completions_to_log must be >= 0"):
            RolloutCallback(**bad)


def test_a_resume_with_other_rollout_settings_warns():
    """group_size, sampling, reward, DAPO options: a resume runs the config's and says what changed."""
    import warnings

    saved = RolloutCallback(reward=CharIsA(), group_size=4, seed=1).state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RolloutCallback(reward=CharIsA(), group_size=4, seed=1).load_state_dict(saved)  # the same: silent
        RolloutCallback(reward=CharIsA(), group_size=4, seed=1).load_state_dict({"seed": 1})  # an older checkpoint
        older = {**saved, "settings": {**saved["settings"], "sampling": {  # before min_p existed
            k: v for k, v in saved["settings"]["sampling"].items() if k != "min_p"}}}
        RolloutCallback(reward=CharIsA(), group_size=4, seed=1).load_state_dict(older)
    changed = RolloutCallback(reward=MathAccuracy(), group_size=8, sampling=SamplingSettings(temperature=0.7), seed=1)
    with pytest.warns(UserWarning, match="other rollout settings") as record:
        changed.load_state_dict(saved)
    text = str(record[0].message)
    assert "'group_size': (4, 8)" in text and "'reward': ('CharIsA', 'MathAccuracy')" in text and "temperature" in text


def test_a_resume_with_another_seed_warns():
    """A callback whose seed follows seed_everything draws another stream if a resume changed it."""
    aqn, rollout = AQNCallback(controller=ConstantNoise(sigma=0.0), seed=1), RolloutCallback(reward=CharIsA(), seed=1)
    for cb, what in ((aqn, "AQNCallback"), (rollout, "RolloutCallback")):
        state = cb.state_dict()
        assert state["seed"] == 1
        cb.load_state_dict(state)  # the same seed: silent
        with pytest.warns(UserWarning, match=f"{what} .*: seed 1, the checkpoint's 7: from here on the run differs"):
            cb.load_state_dict({**state, "seed": 7})


def _tiny_fit(tmp_path, module, max_steps, ckpt_path=None, **trainer_kwargs):
    import lightning as L

    from lightning_modules.data import PromptDataModule

    module.configure_model()
    cb = RolloutCallback(reward=Parity(), group_size=2, sampling=SamplingSettings(max_new_tokens=4))
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                        callbacks=[cb, *trainer_kwargs.pop("callbacks", [])], default_root_dir=tmp_path, **trainer_kwargs)
    trainer.fit(module, PromptDataModule(prompts_per_step=2), ckpt_path=ckpt_path)
    return trainer


def test_ten_non_finite_updates_in_a_row_stop_with_the_step_whose_weights_cause_them(tmp_path, monkeypatch):
    import pytest

    import lightning_modules.qerl_module as qerl_module
    from lightning_modules.checkpointing import TrainingDiverged

    policy_loss = qerl_module.policy_loss
    calls = []

    def nan_after_two(*args, **kwargs):  # batches 0-1 train, every later loss is NaN
        loss, metrics = policy_loss(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan"), metrics) if len(calls) > 2 else (loss, metrics)

    monkeypatch.setattr(qerl_module, "policy_loss", nan_after_two)
    module = QeRLModule(model="tiny-qwen2", quantization="nvfp4", dtype="fp32")
    with pytest.warns(UserWarning, match="skipping this update"), pytest.raises(
            TrainingDiverged, match=r"the 10 updates since step 2 all had a non-finite loss .* weights are still "
                                    r"those of step 2.*Checkpoints of step 2 and later"):
        _tiny_fit(tmp_path, module, 20, enable_checkpointing=False)


def test_an_update_that_overflows_the_weights_stops_before_its_checkpoint(tmp_path):
    """A finite gradient can still make weights non-finite (an lr or weight decay that overflows them;
    simulated: the optimizer's second step writes an inf): the run stops at that step, before its
    checkpoint, so every checkpoint on disk is finite and the message names the step to resume from."""
    import pytest
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from lightning_modules.checkpointing import TrainingDiverged

    steps = []

    def overflow_on_second_step(optimizer, args, kwargs):
        steps.append(1)
        if len(steps) == 2:
            with torch.no_grad():
                optimizer.param_groups[0]["params"][0].fill_(float("inf"))

    module = QeRLModule(model="tiny-qwen2", quantization="nvfp4", dtype="fp32")
    from callbacks.checkpoint import StepCheckpoint

    # (save_on_exception: a checkpoint callback asked to save on any exception skips this one)
    ckpt = StepCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, save_last=True,
                          save_on_exception=True)
    handle = register_optimizer_step_post_hook(overflow_on_second_step)
    try:
        with pytest.raises(TrainingDiverged, match=r"optimizer step 2 made 1 of \d+ trainable tensors non-finite or "
                                                   r"overflowing .*resume from a checkpoint of step 1 or earlier"):
            _tiny_fit(tmp_path, module, 4, callbacks=[ckpt])
    finally:
        handle.remove()
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt"))
    assert saved == ["epoch=0-step=1.ckpt", "last.ckpt"], saved
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["state_dict"]
    assert state and all(torch.isfinite(t).all() for t in state.values())
    # a checkpoint written with non-finite weights (by an older version) is refused on resume, in one line
    ckpt_data = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    next(iter(ckpt_data["state_dict"].values())).fill_(float("nan"))
    torch.save(ckpt_data, tmp_path / "nan.ckpt")
    with pytest.raises(ValueError, match=r"the checkpoint holds non-finite weights \(1 of \d+ trainable tensors"):
        _tiny_fit(tmp_path, QeRLModule(model="tiny-qwen2", quantization="nvfp4", dtype="fp32"), 4,
                  ckpt_path=str(tmp_path / "nan.ckpt"))


def test_table_cells_survive_tensorboards_markdown():
    """The completions table as TensorBoard's text tab renders it: MATH's `\\|x\\|` ended a cell at the
    escaped pipe and a `\\r` ended the row, so completion, answer, gold and reward went missing."""
    import re

    from tensorboard import plugin_util

    from callbacks.rollout import table_cell

    values = ["If $\\|x\\| = 2$ what is $\\|2x\\|$?", "line\rnext\r\nlast", "a | b", "\\frac{1}{2}\\", "x" * 2000]
    rows = ["| text | after |", "|---|---|"] + [f"| {table_cell(v)} | end |" for v in values]
    html = plugin_util.markdown_to_safe_html("\n".join(rows))
    body = re.findall(r"<tr>(.*?)</tr>", html, re.S)[1:]
    cells = [re.findall(r"<td>(.*?)</td>", row, re.S) for row in body]
    assert [c[1] for c in cells] == ["end"] * len(values)
    assert cells[0][0] == "If $\\|x\\| = 2$ what is $\\|2x\\|$?"
    assert cells[1][0] == "line<br>next<br>last" and cells[2][0] == "a | b" and cells[3][0] == "\\frac{1}{2}\\"
    assert cells[4][0] == "x" * 1000



@pytest.mark.parametrize("names, reason", [(["no_such_norm"], "no module name ends with"),
                                           (["q_proj"], "is not an RMSNorm")])
def test_aqn_module_names_that_match_no_norm_name_the_setting(names, reason):
    """The error said what was wrong with the modules (and "leave AQN out" for a linear), not which setting chose them."""
    module = _module()
    with pytest.raises(ValueError, match=rf"^AQNCallback.module_names=\['{names[0]}'\]: .*{reason}"):
        AQNCallback(controller=ConstantNoise(0.01), module_names=names).on_fit_start(_trainer([]), module)


def test_no_signal_warning_sees_through_overlong_shaping():
    """Every group flat on the task (a broken reward, say) while the length penalty separates its
    completions: the trained rewards differ, the task signal is nil, and the warning's measure says so."""
    module = _module()
    tok = module.tokenizer
    enc = lambda s: tok(s)["input_ids"]  # noqa: E731
    script = {tuple(enc("x")): [enc("b"), enc("bbbb")], tuple(enc("y")): [enc("bb"), enc("bbb")]}
    for dynamic in (True, False):
        cb = RolloutCallback(reward=CharIsA(), group_size=2, sampling=SamplingSettings(max_new_tokens=4),
                             dynamic_sampling=dynamic, max_refill_rounds=0, overlong_buffer=4)
        cb.engine = ScriptedEngine(script)
        batch = {"prompt_ids": [enc("x"), enc("y")], "prompts": ["x", "y"], "answers": ["-", "-"]}
        cb.on_train_batch_start(_trainer([cb]), module, batch, 0)
        r = batch["rollout"]
        assert r.rewards.view(2, 2).std(-1).min() > 0  # shaped: no group's rewards are all equal
        assert r.frac_task_zero_std() == 1.0


def test_silent_failure_warnings_count_rollout_batches_and_ninety_percent_exactly():
    """36 of 40 truncated is 90% (a float32 mean made it 0.8999999761 and the warning never fired)."""
    from lightning_modules.step_metrics import mostly_truncated

    truncated = torch.tensor([True] * 36 + [False] * 4)
    assert float(truncated.float().mean()) < 0.9  # what the old comparison saw
    assert mostly_truncated(truncated) and not mostly_truncated(truncated[1:])  # 36 of 40, 35 of 39
    module = QeRLModule(model="tiny-qwen2", quantization="nvfp4", dtype="fp32", warn_after_steps=2)
    module._world_size = lambda: 1
    with pytest.warns(UserWarning, match=r"^>= 90% of completions hit max_new_tokens for 2 rollout batches"):
        for _ in range(2):
            module._warn_on_silent_failures(0.0, mostly_truncated(truncated))


def test_training_at_temperature_zero_is_refused_and_an_empty_table_is_not_written():
    with pytest.raises(ValueError, match="sampling.temperature must be > 0 for training"):
        RolloutCallback(sampling=SamplingSettings(temperature=0.0))
    module = _module()
    enc = lambda s: module.tokenizer(s)["input_ids"]  # noqa: E731
    cb = RolloutCallback(reward=CharIsA(), group_size=2, sampling=SamplingSettings(max_new_tokens=4),
                         log_completions_every_n_steps=1, num_completions_to_log=0)
    cb.engine = ScriptedEngine({tuple(enc("x")): [enc("a"), enc("b")]})
    tables = []
    cb._log_table = lambda *a: tables.append(a)
    batch = lambda: {"prompt_ids": [enc("x")], "prompts": ["x"], "answers": ["-"]}  # noqa: E731
    cb.on_train_batch_start(_trainer([cb]), module, batch(), 0)
    assert tables == []
    cb.num_to_log = 1  # the control: the same step writes one
    cb.on_train_batch_start(_trainer([cb]), module, batch(), 0)
    assert len(tables) == 1
