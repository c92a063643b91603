"""Data-parallel training (Lightning DDP: 2 CPU processes over gloo; on a 2-GPU machine also 2 GPUs
over NCCL, bf16, through the NVFP4 kernels) through the real CLI.

The frozen NVFP4 base is not broadcast (each rank builds it from ``model``; NVFP4 tensors cannot
go into DDP's flat buckets): only LoRA is synced. After training, both ranks must hold the same
LoRA weights, and those must have moved."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parent.parent
# 2 CPU processes (gloo, fp32) everywhere; 2 GPUs (NCCL, bf16 through the NVFP4 kernels) where there are two
TWO_RANKS = pytest.mark.parametrize("accelerator, dtype", [
    ("cpu", "fp32"),
    pytest.param("gpu", "bf16", marks=[pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                                            reason="needs 2 GPUs")])])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # bf16: fp32 adapters on a bf16 model, as on GPUs
def test_ddp_two_cpu_ranks_train_the_same_lora(tmp_path, dtype):
    _ddp_two_ranks(tmp_path, "cpu", dtype)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ddp_two_gpus_train_the_same_lora(tmp_path):
    _ddp_two_ranks(tmp_path, "gpu", "bf16")      # the NVFP4 kernels' dtype


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2 or importlib.util.find_spec("vllm") is None,
                    reason="needs 2 GPUs and vLLM")
def test_ddp_two_gpus_vllm_engine(tmp_path):
    """engine: vllm under DDP: one colocated vLLM per rank (vLLM's external launcher, each rank its own
    GPU and prompts), adapters pushed per rank, sleep/wake around training, validation in vLLM too."""
    from qerl.tiny import build_tiny_model, build_tiny_tokenizer
    small = tmp_path / "small"              # dims Marlin and vLLM's attention take (head_dim 128)
    build_tiny_model("qwen2", hidden_size=256, intermediate_size=512, num_heads=2, num_kv_heads=1,
                     dtype=torch.bfloat16).save_pretrained(small)
    build_tiny_tokenizer().save_pretrained(small)

    def vllm(cfg):
        cfg["model"]["model"] = str(small)
        for cb in cfg["trainer"]["callbacks"]:
            if cb["class_path"].endswith("RolloutCallback"):
                cb["init_args"].update(engine="vllm", vllm={"gpu_memory_utilization": 0.2, "max_model_len": 512,
                                                            "llm_kwargs": {"enforce_eager": True}})
    _ddp_two_ranks(tmp_path, "gpu", "bf16", edit=vllm)


def test_ddp_dynamic_sampling_ranks_keep_different_group_counts(tmp_path):
    """DAPO's dynamic sampling under DDP: a reward that gives rank 0 signal in both groups and rank 1
    in one makes the ranks keep 2 and 1 groups; with one group per micro-batch that would be 2 vs 1
    backward passes (gradient all-reduces) and a hang. The ranks must agree on the group count."""
    (tmp_path / "skewed.py").write_text(textwrap.dedent("""
        import torch.distributed as dist
        from qerl.rewards import RewardFunction

        class RankSkewedReward(RewardFunction):
            name = "skewed"

            def compute(self, completions, answers):
                rank = dist.get_rank() if dist.is_initialized() else 0
                if rank == 0:
                    return [float(i % 2) for i in range(len(completions))]    # every group has signal
                return [float(i == 0) for i in range(len(completions))]        # only the first group
    """))

    def dynamic(cfg):
        for cb in cfg["trainer"]["callbacks"]:
            if cb["class_path"].endswith("RolloutCallback"):
                cb["init_args"].update(dynamic_sampling=True, max_refill_rounds=0, overlong_buffer=0,
                                       reward={"class_path": "skewed.RankSkewedReward"})
                cfg["model"]["loss"]["micro_batch_size"] = cb["init_args"]["group_size"]
    _ddp_two_ranks(tmp_path, "cpu", "fp32", edit=dynamic, timeout=300)
    # each rank trained on one group: rank 0's rewards (0, 1, 0, 1), rank 1's (1, 0, 0, 0); the curves
    # show both ranks (sync_dist): mean reward 0.375 on every rank, not 0.5 / 0.25
    for r in (0, 1):
        logged = torch.load(tmp_path / f"logged{r}.pt")
        assert abs(logged["train/reward"] - 0.375) < 1e-6 and abs(logged["train/rewards/skewed"] - 0.375) < 1e-6, logged
        assert logged["train/groups_dropped"] == 1.0      # rank 0 its surplus group, rank 1 its flat one
        # every sampled group's reward (before the filter): rank 0's 8 completions 0.5, rank 1's 0.125;
        # the AQN state monitor (closed-loop controllers) watches it, reduced over both ranks
        assert abs(logged["train/reward_sampled"] - 0.3125) < 1e-6, logged
        assert logged["aqn_monitor_rewards"] == pytest.approx([0.3125, 0.3125]), logged["aqn_monitor_rewards"]


def test_ddp_dynamic_sampling_with_refills_runs_in_step(tmp_path):
    """Refill rounds under DDP: the ranks gather the step's prompts (a collective) before they refill,
    each rank as often as its own groups need; the ranks end with the same LoRA."""
    def refills(cfg):
        for cb in cfg["trainer"]["callbacks"]:
            if cb["class_path"].endswith("RolloutCallback"):
                cb["init_args"].update(dynamic_sampling=True, max_refill_rounds=2)
    _ddp_two_ranks(tmp_path, "cpu", "fp32", edit=refills, timeout=300)


@TWO_RANKS
def test_ddp_dapo_and_batch_std_normalise_over_all_ranks(tmp_path, accelerator, dtype):
    """dapo divides each rank's token sum by the global token count / W (DDP averages the ranks'
    gradients: the global token mean), advantage_scale: batch divides by the std of every rank's
    rewards, and top_entropy_quantile takes its threshold over every rank's tokens. Rank 1's
    completions are cut to half length, so the ranks' token counts differ."""
    (tmp_path / "record_norms.py").write_text(textwrap.dedent(f"""
        import torch, torch.distributed as dist, lightning as L
        import lightning_modules.qerl_module as qm
        from qerl.rewards import RewardFunction

        class RankReward(RewardFunction):
            name = "by_rank"

            def compute(self, completions, answers):
                rank = dist.get_rank() if dist.is_initialized() else 0
                return [float((i + rank) % 3 == 0) for i in range(len(completions))]

        class RecordNormalisers(L.Callback):
            rows = []

            def on_fit_start(self, trainer, pl_module):
                normaliser, advantages = pl_module.token_normaliser, qm.group_advantages

                def recorded_normaliser(mask):
                    out = normaliser(mask)
                    self.rows.append(("tokens", float(mask.sum()), float(out)))
                    return out

                def recorded_advantages(rewards, group_size, scale, **kw):
                    out = advantages(rewards, group_size, scale, **kw)
                    self.rows.append(("advantages", rewards.tolist(), out.tolist()))
                    return out

                def recorded_high_entropy(entropy, mask, quantile, all_entropies=None):
                    out = high_entropy(entropy, mask, quantile, all_entropies=all_entropies)
                    pool = all_entropies.float()
                    self.rows.append(("entropy", int(mask.sum()), pool.numel(), float(pool.sum())))
                    return out
                pl_module.token_normaliser, qm.group_advantages = recorded_normaliser, recorded_advantages
                high_entropy, qm.high_entropy_mask = qm.high_entropy_mask, recorded_high_entropy

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if trainer.global_rank == 1:   # after the RolloutCallback attached the rollout
                    mask = batch["rollout"].completion_mask
                    mask[:, mask.shape[1] // 2:] = 0

            def on_train_end(self, trainer, pl_module):
                torch.save(self.rows, f"{tmp_path}/norms{{trainer.global_rank}}.pt")
    """))

    def dapo(cfg):
        cfg["model"]["loss"].update(aggregation="dapo", advantage_scale="batch", top_entropy_quantile=0.2)
        for cb in cfg["trainer"]["callbacks"]:
            if cb["class_path"].endswith("RolloutCallback"):
                cb["init_args"]["reward"] = {"class_path": "record_norms.RankReward"}
                cb["init_args"]["overlong_buffer"] = 0
        cfg["trainer"]["callbacks"].append({"class_path": "record_norms.RecordNormalisers"})
    _ddp_fit(tmp_path, accelerator, dtype, edit=dapo, timeout=300)
    rows = [torch.load(tmp_path / f"norms{r}.pt") for r in (0, 1)]
    tokens = [[row[1:] for row in rank if row[0] == "tokens"] for rank in rows]
    advantages = [[row[1:] for row in rank if row[0] == "advantages"] for rank in rows]
    assert len(tokens[0]) == len(tokens[1]) == 2  # one per training step
    for (n0, out0), (n1, out1) in zip(*tokens):
        assert n0 != n1 and out0 == out1 == pytest.approx((n0 + n1) / 2)
    group = 4  # the quickstart's group size
    for (r0, a0), (r1, a1) in zip(*advantages):
        std = torch.tensor(r0 + r1).std()
        for rewards, adv in ((r0, a0), (r1, a1)):
            r = torch.tensor(rewards).view(-1, group)
            expected = ((r - r.mean(1, keepdim=True)) / (std + 1e-4)).view(-1)
            assert torch.allclose(torch.tensor(adv), expected, atol=1e-6), (rewards, adv, expected)
        assert torch.tensor(r0).std() != pytest.approx(float(std))  # not vacuous: local std differs
    # top_entropy_quantile: one threshold over both ranks' valid tokens (the same pool on each rank)
    pools = [[row[1:] for row in rank if row[0] == "entropy"] for rank in rows]
    assert len(pools[0]) == len(pools[1]) == 2, pools  # one per training step on each rank
    for (n0, size0, sum0), (n1, size1, sum1) in zip(*pools):
        assert n0 != n1 and size0 == size1 == n0 + n1 and sum0 == pytest.approx(sum1), pools


@TWO_RANKS
def test_ddp_a_non_finite_loss_on_one_rank_skips_the_update_on_all(tmp_path, accelerator, dtype):
    """A NaN reward on rank 1 only (first step) makes its loss NaN: both ranks must skip that update
    together (else rank 0 waits in a gradient all-reduce that rank 1 never joins) and stay equal."""
    (tmp_path / "nanreward.py").write_text(textwrap.dedent("""
        import torch.distributed as dist
        from qerl.rewards import RewardFunction

        class NaNOnRank1First(RewardFunction):
            name = "nan_once"
            calls = 0

            def compute(self, completions, answers):
                NaNOnRank1First.calls += 1
                bad = dist.is_initialized() and dist.get_rank() == 1 and NaNOnRank1First.calls == 1
                return [float("nan") if bad else float(i % 2) for i in range(len(completions))]
    """))

    def nan_reward(cfg):
        for cb in cfg["trainer"]["callbacks"]:
            if cb["class_path"].endswith("RolloutCallback"):
                cb["init_args"]["reward"] = {"class_path": "nanreward.NaNOnRank1First"}
    _ddp_two_ranks(tmp_path, accelerator, dtype, edit=nan_reward, timeout=300)


@TWO_RANKS
def test_ddp_resume_matches_straight_run(tmp_path, monkeypatch, accelerator, dtype):
    """2 ranks: 2 steps, a checkpoint, ``--ckpt_path last`` for 2 more equals 4 steps straight (data
    position, AQN step, optimizer and LoRA restored on both ranks, and with LoRA dropout each rank's
    own global generators, which differ once the ranks have drawn different amounts; on GPUs the
    dropout masks come from each rank's CUDA generator, over NCCL)."""
    # the kernels' autotuner times candidates, and two runs may pick different ones (a different
    # split-K summation order): a bit-exact comparison pins each bucket's default config
    monkeypatch.setenv("QERL_KERNELS_AUTOTUNE", "0")
    reward_src = textwrap.dedent("""
        import torch, torch.distributed as dist
        from qerl.rewards import RewardFunction

        class RankDrawsReward(RewardFunction):      # a reward that samples (a judge, a verifier...):
            name = "draws"                          # rank 1's global generator moves ahead of rank 0's

            def compute(self, completions, answers):
                torch.rand(1 + 3 * (dist.get_rank() if dist.is_initialized() else 0))
                return [float(i % 2) for i in range(len(completions))]
    """)
    for run in ("straight", "resumed"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "rngreward.py").write_text(reward_src)

    def resumable(steps, run):
        def edit(cfg):
            cfg["trainer"]["max_steps"] = steps
            cfg["trainer"]["val_check_interval"] = 100        # no validation: only training differs
            cfg["model"]["optimizer"]["schedule"] = "constant"  # a cosine spans max_steps (2 vs 4)
            cfg["model"]["lora"]["dropout"] = 0.2               # the ranks' global generators matter too
            for cb in cfg["trainer"]["callbacks"]:
                if cb["class_path"].endswith("RolloutCallback"):
                    cb["init_args"]["reward"] = {"class_path": "rngreward.RankDrawsReward"}
                if cb["class_path"].endswith("AQNCallback"):  # the AQN stages span max_steps too
                    cb["init_args"]["controller"].setdefault("init_args", {})["max_steps"] = 20
            cfg["trainer"]["callbacks"].insert(0, {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"dirpath": str(tmp_path / run / "ckpt"), "save_last": True, "every_n_train_steps": 1}})
        return edit
    straight = _ddp_fit(tmp_path / "straight", accelerator, dtype, edit=resumable(4, "straight"))
    _ddp_fit(tmp_path / "resumed", accelerator, dtype, edit=resumable(2, "resumed"))
    ckpt = torch.load(tmp_path / "resumed" / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 2
    resumed = _ddp_fit(tmp_path / "resumed", accelerator, dtype, edit=resumable(4, "resumed"),
                       args=["--ckpt_path", "last"])
    for r in (0, 1):
        a, b = straight[r], resumed[r]
        assert a.keys() == b.keys()
        for name in a:
            assert torch.allclose(a[name], b[name], atol=1e-6), (r, name, (a[name] - b[name]).abs().max())


def _ddp_fit(tmp_path, accelerator: str = "cpu", dtype: str = "fp32", edit=None, args=(), timeout: int = 600):
    """``train.py fit`` of the shortened quickstart on 2 DDP ranks in a subprocess; returns each
    rank's trainable parameters at the end ({rank: {name: tensor}})."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "dump_lora.py").write_text(textwrap.dedent(f"""
        import torch, lightning as L

        class DumpLoRA(L.Callback):
            def on_train_end(self, trainer, pl_module):
                lora = {{n: p.detach().clone() for n, p in pl_module.model.named_parameters() if p.requires_grad}}
                torch.save(lora, f"{tmp_path}/rank{{trainer.global_rank}}.pt")
                logged = {{k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}}
                aqn = [cb for cb in trainer.callbacks if type(cb).__name__ == "AQNCallback"]
                logged["aqn_monitor_rewards"] = list(aqn[0].monitor.rewards) if aqn else []
                torch.save(logged, f"{tmp_path}/logged{{trainer.global_rank}}.pt")
    """))
    cfg = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    cfg["trainer"].update(max_steps=2, strategy="ddp", devices=2, enable_progress_bar=False, val_check_interval=2,
                          accelerator=accelerator)
    cfg["model"]["dtype"] = dtype
    cfg["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "logs")
    cfg["trainer"]["callbacks"] = [cb for cb in cfg["trainer"]["callbacks"] if "ModelCheckpoint" not in cb["class_path"]]
    cfg["trainer"]["callbacks"].append({"class_path": "dump_lora.DumpLoRA"})
    for cb in cfg["trainer"]["callbacks"]:
        if cb["class_path"].endswith("RolloutCallback"):
            cb["init_args"]["sampling"]["max_new_tokens"] = 12
            cb["init_args"]["overlong_buffer"] = 12
    cfg["data"]["prompts_per_step"] = 2
    if edit is not None:
        edit(cfg)
    (tmp_path / "ddp.yaml").write_text(yaml.safe_dump(cfg))
    path = os.pathsep.join(p for p in (str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "fit", "--config", str(tmp_path / "ddp.yaml"), *args],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)         # its own process group: the ranks die together
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the DDP run did not finish in {timeout} s (ranks out of step in a collective?)")
    assert proc.returncode == 0, stderr[-3000:]
    return {r: torch.load(tmp_path / f"rank{r}.pt", map_location="cpu") for r in (0, 1)}


def _ddp_two_ranks(tmp_path, accelerator: str, dtype: str, edit=None, timeout: int = 600):
    """A 2-rank fit whose ranks must end with the same, trained LoRA, the adapter written once and
    the validation report listing every problem once."""
    lora = _ddp_fit(tmp_path, accelerator, dtype, edit=edit, timeout=timeout)
    rank0, rank1 = lora[0], lora[1]
    assert rank0.keys() == rank1.keys() and all("lora_" in n for n in rank0)
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    assert any(rank0[n].abs().max() > 0 for n in rank0 if "lora_B" in n)  # B starts at 0: it trained
    assert list((tmp_path / "logs").glob("*/version_0/adapter/adapter_config.json"))  # rank 0 wrote it
    # each rank validated half of the 8 problems; the report lists all of them, once, in order
    report = json.loads(next((tmp_path / "logs").glob("*/version_0/eval/val_step*.json")).read_text())
    indices = [row["index"] for row in report["completions"]["arithmetic"]]
    assert indices == list(range(8)) and report["metrics"]["arithmetic"]["problems"] == 8


def test_ddp_reward_by_source_is_over_every_rank(tmp_path):
    """Two training sets on 2 CPU ranks, rewards that depend on the rank: each set's point is its
    reward sum over both ranks / its completions over both ranks (not rank 0's view, not a mean of
    the ranks' means), at the step the batch started."""
    for name, gold in (("ones", 1), ("twos", 2)):
        rows = [{"question": f"What is {i} + {gold - i}?", "answer": f"#### {gold}"} for i in range(8)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "by_source.py").write_text(textwrap.dedent(f"""
        import torch, torch.distributed as dist, lightning as L
        from qerl.rewards import RewardFunction

        class RankAndGold(RewardFunction):
            name = "rank_and_gold"

            def compute(self, completions, answers):
                rank = dist.get_rank() if dist.is_initialized() else 0
                return [float(a == "1") + 0.25 * rank + 0.125 * (i % 2) for i, a in enumerate(answers)]

        class RecordRows(L.Callback):
            rows = []

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                r = batch["rollout"]
                start = trainer.global_step - pl_module.loss_settings.updates_per_rollout  # (the logged step)
                self.rows.append((start, list(r.sources), r.rewards.tolist()))

            def on_train_end(self, trainer, pl_module):
                torch.save(self.rows, f"{tmp_path}/rows{{trainer.global_rank}}.pt")
    """))

    def two_sets(cfg):
        cfg["data"]["train_source"] = [str(tmp_path / "ones.jsonl"), str(tmp_path / "twos.jsonl")]
        cfg["data"]["prompts_per_step"] = 3
        for cb in cfg["trainer"]["callbacks"]:
            if cb["class_path"].endswith("RolloutCallback"):
                cb["init_args"].update(reward={"class_path": "by_source.RankAndGold"}, overlong_buffer=0)
        cfg["trainer"]["callbacks"].append({"class_path": "by_source.RecordRows"})
    _ddp_fit(tmp_path, edit=two_sets, timeout=300)
    sums, per_rank = {}, {}
    for rank in (0, 1):
        for step, sources, rewards in torch.load(tmp_path / f"rows{rank}.pt"):
            for source, reward in zip(sources, rewards):
                name = "ones" if source.endswith("ones.jsonl") else "twos"
                total, count = sums.get((step, name), (0.0, 0))
                sums[(step, name)] = (total + reward, count + 1)
                per_rank[(rank, step, name)] = per_rank.get((rank, step, name), 0) + 1
    # not vacuous: somewhere the ranks drew a set unequally often (there a mean of the ranks' means differs)
    assert any(per_rank.get((0, step, name), 0) != per_rank.get((1, step, name), 0) for step, name in sums)
    files = list((tmp_path / "logs").glob("**/events.out.tfevents.*"))
    acc = EventAccumulator(str(files[0]))
    acc.Reload()
    logged = {(e.step, name): e.value for name in ("ones", "twos")
              for e in (acc.Scalars(f"train/reward_by_source/{name}")
                        if f"train/reward_by_source/{name}" in acc.Tags()["scalars"] else [])}
    assert logged and logged.keys() == sums.keys()
    for key, (total, count) in sums.items():
        assert logged[key] == pytest.approx(total / count, rel=1e-6), key


def _gather_on_rank(rank: int, init_file: str, out: str) -> None:
    from types import SimpleNamespace

    import torch.distributed as dist

    from callbacks.rollout import every_rank_items

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    got = every_rank_items(SimpleNamespace(world_size=2), [("s", rank), ("t", 10 + rank)])
    torch.save(got, f"{out}{rank}.pt")
    dist.destroy_process_group()


def test_every_rank_items_gathers_the_ranks_prompts(tmp_path):
    """DAPO refills pass over every rank's prompts of the step (the gradients are all-reduced: one step),
    gathered by every_rank_items; in one process the items themselves."""
    import torch.multiprocessing as mp

    from callbacks.rollout import every_rank_items

    assert every_rank_items(object(), [("s", 1)]) == [("s", 1)]
    mp.spawn(_gather_on_rank, args=(str(tmp_path / "init"), str(tmp_path / "got")), nprocs=2)
    for rank in (0, 1):
        assert torch.load(tmp_path / f"got{rank}.pt") == [("s", 0), ("t", 10), ("s", 1), ("t", 11)]
