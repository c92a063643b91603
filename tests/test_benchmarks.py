"""The benchmark scripts users run on the GPU also run end to end on CPU (tiny shape): their JSON
has the documented rows, so a broken script is caught here rather than on the lent GPU."""

import glob
import importlib.util
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_step_benchmark_tiny(tmp_path):
    arms = ["bf16", "nvfp4"] + (["nf4"] if importlib.util.find_spec("bitsandbytes") else [])
    out = tmp_path / "ts.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "train_step.py"), "--shape", "tiny",
                        "--arms", ",".join(arms), "--batch", "2", "--seq", "33", "--gen-batch", "2",
                        "--gen-prompt", "8", "--gen-new", "8", "--lora-compute", "model,stored", "--profile", "--host-profile", "--fused-ops", "off,on",
                        "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert sorted((r["arm"], r["lora_compute"], r["fused_ops"]) for r in res["rows"]) == sorted(
        (a, c, f) for a in arms for c in ("model", "stored") for f in (False, True))
    for row in res["rows"]:      # the profile: named categories whose times add up to something
        assert row["profile"] and sum(c["ms"] for c in row["profile"]) > 0
        update = {"weights_gb", "train_step_s", "train_host_s", "train_peak_gb"}
        assert set(row["vs_stored"]) == set(row["vs_unfused"]) == update  # generation: one measurement per model
        # the host profile names Python functions; the host's enqueue time is within the update's
        assert row["host_profile"] and all(r["calls"] > 0 and ":" in r["function"] for r in row["host_profile"])
        assert 0 < row["train_host_s"] <= row["train_step_s"]
        # per round: the update's and host's times beside the host clock (allocator counters on CUDA)
        assert len(row["round_step_s"]) == len(row["round_host_s"]) == len(row["round_context"]) == 1
        assert "host_cpu_mhz" in row["round_context"][0]
    rows = {row["arm"]: row for row in res["rows"] if row["lora_compute"] == "model" and not row["fused_ops"]}
    for row in rows.values():
        for k in ("weights_gb", "train_step_s", "gen_tok_s"):
            assert math.isfinite(row[k]) and row[k] > 0, (row["arm"], k, row[k])
        assert row["decoder_linears_gb"] < row["weights_gb"]
        assert set(row["vs_bf16"]) == {"weights_gb", "train_step_s", "train_host_s", "train_peak_gb", "gen_tok_s"}
    # the packed base is smaller even on the tiny model, whose embeddings dominate
    assert rows["nvfp4"]["weights_gb"] < rows["bf16"]["weights_gb"]
    assert res["meta"]["shape"] == "tiny" and res["meta"]["gradient_checkpointing"] is True
    # bf16: every base parameter once, 2 bytes each (no double counting of the LoRA-wrapped linears)
    from transformers import AutoModelForCausalLM, Qwen2Config
    spec = importlib.util.spec_from_file_location("rollout_hf_bench", os.path.join(ROOT, "benchmarks", "rollout_hf.py"))
    rollout_hf = importlib.util.module_from_spec(spec)      # (not via sys.path: benchmarks/kernels.py would
    spec.loader.exec_module(rollout_hf)                      # shadow the kernels package for later tests)
    ref = AutoModelForCausalLM.from_config(Qwen2Config(**rollout_hf.SHAPES["tiny"], tie_word_embeddings=False))
    assert abs(rows["bf16"]["weights_gb"] * 1024 ** 3 - 2 * sum(p.numel() for p in ref.parameters())) < 1


def test_train_step_benchmark_left_padded_with_and_without_cudnn(tmp_path):
    """``--left-pad``: the rows fed with the trainer's explicit mask; ``--cudnn-attention on,off``:
    one row per setting, the second against the first (on the CPU both run the same attention)."""
    out = tmp_path / "ts.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "train_step.py"), "--shape", "tiny",
                        "--arms", "nvfp4", "--batch", "3", "--seq", "17", "--left-pad", "6", "--skip-gen",
                        "--cudnn-attention", "on,off", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [(row["cudnn_attention"], row["left_pad"]) for row in res["rows"]] == [(True, 6), (False, 6)]
    assert set(res["rows"][1]["vs_cudnn"]) == {"weights_gb", "train_step_s", "train_host_s", "train_peak_gb"}
    assert res["meta"]["left_pad"] == 6
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "train_step.py"), "--shape", "tiny",
                          "--seq", "17", "--left-pad", "16"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--left-pad must be in [0, seq - 1)" in bad.stderr


def test_rollout_hf_benchmark_tiny_every_variant(tmp_path):
    spec = importlib.util.spec_from_file_location("rollout_hf_bench", os.path.join(ROOT, "benchmarks", "rollout_hf.py"))
    rollout_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rollout_hf)
    variants = list(rollout_hf.VARIANTS)
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "rollout_hf.py"), "--shape", "tiny",
                        "--batches", "1,2", "--prompt", "8", "--new", "6", "--modes", "eager",
                        "--variants", ",".join(variants), "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert sorted({(x["quantization"], x["engine"], x["B"]) for x in rows}) == sorted(
        (q, v, b) for q in ("bf16", "nvfp4") for v in variants for b in (1, 2))
    assert all(math.isfinite(x["tok_s"]) and x["tok_s"] > 0 for x in rows)


def test_wgmma_stages_variants_match_the_kernel_source():
    """benchmarks/wgmma_stages.py edits the wgmma kernel's source text: every fragment it replaces
    must still be there (the GPU run would stop at the first missing one)."""
    spec = importlib.util.spec_from_file_location("wgmma_stages_bench", os.path.join(ROOT, "benchmarks", "wgmma_stages.py"))
    stages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stages)
    from kernels import nvfp4_wgmma
    for variant, edits in stages.VARIANTS.items():
        body = nvfp4_wgmma._BODY
        for old, new in edits:
            assert old in body, (variant, old[:60])
            body = body.replace(old, new)
        assert variant == "full" or body != nvfp4_wgmma._BODY


def test_decode_layout_search_finds_partitions_when_they_exist():
    from benchmarks.decode_layout_search import M, exact_cover, funnel_windows

    byte = tuple(range(8))  # a contiguous byte tiles a word with 4 shifts
    assert sorted(exact_cover(32, funnel_windows(1, byte))) == [(0, 0, 0), (0, 0, 8), (0, 0, 16), (0, 0, 24)]
    split = (0, 1, 2, 9, 16, 17, 18, 25)  # M moved down by 6: still no partition
    assert exact_cover(32, funnel_windows(1, split)) is None
    assert exact_cover(32, funnel_windows(1, M)) is None and exact_cover(64, funnel_windows(2, M)) is None


def test_micro_batching_benchmark_tiny(tmp_path):
    """The three micro-batch layouts run and compute ever fewer positions: padded >= cut >= grouped."""
    out = tmp_path / "mb.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "micro_batching.py"), "--shape", "tiny",
                        "--quantization", "nvfp4", "--n", "8", "--prompt", "8", "--new", "16", "--micro", "3",
                        "--mean", "8", "--std", "5", "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["padded", "cut", "grouped"]
    assert rows["padded"]["tokens"] == 8 * (8 + 16 - 1)  # every column but the last (its logit predicts nothing)
    assert rows["padded"]["tokens"] >= rows["cut"]["tokens"] >= rows["grouped"]["tokens"]
    assert rows["grouped"]["tokens"] < rows["padded"]["tokens"]
    assert all(math.isfinite(row["seconds"]) and row["seconds"] > 0 for row in rows.values())


def test_sampler_benchmark_tiny(tmp_path):
    out = tmp_path / "sampler.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sampler.py"), "--batches", "1,4",
                        "--vocab", "64", "--iters", "3", "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["B"] for row in rows] == [1, 4]
    assert all(row["multinomial_ms"] > 0 and row["inverse_cdf_ms"] > 0 and math.isfinite(row["ratio"]) for row in rows)


def test_eval_seeds_benchmark_tiny_fp32_draws_identical_samples(tmp_path):
    """In fp32 the embedded engine's logits do not depend on the batch: every problem's samples match."""
    out = tmp_path / "es.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "eval_seeds.py"), "--engine", "hf",
                        "--accelerator", "cpu", "--dtype", "fp32", "--max-new-tokens", "6", "--samples", "2",
                        "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["batches"] == [8, 3] and row["problems"] == 8 and row["identical_problems"] == 8


def test_nonfinite_hunt_runs_train_py_and_writes_its_findings(tmp_path):
    """benchmarks/nonfinite_hunt.py wraps the real CLI (here the shortened quickstart, 2 steps): the
    run trains, every check runs, and a healthy run has nothing to report. (What it reports on a
    broken backward: tests/test_training_step.py's left-padding test.)"""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_cli import fast_args

    out = tmp_path / "hunt.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "nonfinite_hunt.py"), "--out", str(out), "--",
                        "fit", *fast_args(tmp_path, steps=2)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "HUNT done: 0 findings" in r.stdout
    assert json.loads(out.read_text())["findings"] == []
    assert glob.glob(f"{tmp_path}/logs/**/events.out.tfevents.*", recursive=True)


def test_nonfinite_hunt_tells_real_rows_from_padding_rows():
    """A non-finite forward output is reported with how many of its rows are real tokens and how many
    padding, read off the 2-D mask behind the trainer's 4-D one."""
    import torch

    spec = importlib.util.spec_from_file_location("nonfinite_hunt", os.path.join(ROOT, "benchmarks", "nonfinite_hunt.py"))
    hunt_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hunt_module)
    hunt = hunt_module.Hunt()
    hunt._mask = torch.ones(2, 1, 3, 3, dtype=torch.bool)  # what the model was fed
    hunt._padding = torch.tensor([[0, 1, 1], [1, 1, 1]])  # row 0's first token is padding
    out = torch.zeros(2, 3, 4)
    out[0, 0, 1], out[1, 2, 0], out[1, 2, 3] = float("nan"), float("inf"), float("nan")
    hunt._forward_hook("layers.0.mlp")(None, (), out)
    (finding,) = hunt.findings
    assert finding["module"] == "layers.0.mlp" and finding["non_finite"] == 3
    assert finding["real_and_padding_rows"] == [1, 1]  # (1, 2) is real, (0, 0) padding
