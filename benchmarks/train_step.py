"""Memory and speed of the three arms -- 16-bit LoRA, QLoRA (NF4) and QeRL (NVFP4) -- side by side.

    python benchmarks/train_step.py [--shape 7b|0.5b|tiny] [--arms bf16,nf4,nvfp4] [--batch 8] [--seq 512]
        [--gen-batch 8] [--gen-prompt 128] [--gen-new 128] [--lora-compute model,stored] [--profile]
        [--host-profile] [--fused-ops off|on|off,on] [--fused-projections off|on|off,on] [--rounds N] [--skip-gen]
        [--left-pad P] [--cudnn-attention on|off|on,off] [--out PATH]

A Qwen2.5-7B-shaped model with random weights (std 0.02, as ``benchmarks/rollout_hf.py``), LoRA r32
on every decoder linear (non-zero B), gradient checkpointing as in the 7B recipes. Per arm, in one
process, one after another:

* ``weights_gb`` / ``decoder_linears_gb``: the frozen base's bytes and those of its decoder linears
  (``qerl.quantize.base_weight_bytes``: packed for nf4 / nvfp4; embeddings, lm_head and norms in bf16);
* ``train_step_s`` / ``train_peak_gb``: one LoRA update on ``batch x seq`` tokens -- forward, the
  selected-token log-probs through ``qerl.logprobs.selective_log_softmax`` (as the policy loss), backward,
  AdamW step -- median of 3 after a warm-up, and the peak allocated memory of those steps;
* ``train_host_s``: the host's time to enqueue that update (before the closing synchronize): close
  to ``train_step_s`` means Python and launches, not the GPU, set the pace;
* ``gen_tok_s``: the embedded engine (``HFEngine``, CUDA-graph decode where the arm's kernels allow it)
  sampling ``gen-new`` tokens for ``gen-batch`` prompts of ``gen-prompt`` tokens (median of 3 calls after a warm-up;
  each call includes its prefill and the CUDA-graph capture).

``--lora-compute``: each arm once per ``LoraSettings.compute_dtype`` given -- ``model`` (the default:
bf16 matmuls on casts of the fp32 adapter, ``qerl.lora_forward``), ``stored`` (peft's fp32 forward);
rows get ``vs_bf16`` (against bf16 with the same LoRA arithmetic) and ``vs_stored``. ``--profile``:
also the CUDA kernel time of one update per category (``torch.profiler``; rows' ``profile``).
``--fused-ops off,on``: each arm's update without and with ``qerl.fused_ops`` on the same model
(rows' ``fused_ops``, ``vs_unfused``); ``--fused-projections off,on`` the same for
``qerl.rollout.fast_linears.fused_base_projections`` (rows' ``fused_projections``, ``vs_unfused_projections``).
``--left-pad P``: row i of the batch starts with ``i * P // (batch - 1)`` padding tokens, fed
as the trainer feeds a left-padded rollout (``qerl.attention_masks.left_padding_mask``: an explicit
boolean mask, with which SDPA picks cuDNN attention on the H200); 0 (default): no mask, causal
flash attention. ``--cudnn-attention on,off``: the update with SDPA's cuDNN backend allowed and
inside ``without_cudnn_attention`` (``model.cudnn_attention: false``; rows' ``cudnn_attention``,
``vs_cudnn``): what the trainer's recompute of a non-finite update, or switching cuDNN off, costs.
``--rounds N``: the settings of one arm timed N times in turn (every other round reversed), the
median per setting (rows' ``round_step_s``: each round's time). ``--host-profile``: the Python functions that take the
host's time in one update (cProfile; rows' ``host_profile``). ``--skip-gen``: no generation (``gen_tok_s`` null). ``--shape 0.5b``: Qwen2.5-0.5B,
the testbed recipes' model.

``nf4`` needs bitsandbytes (skipped with a note when it does not import). Prints a table; writes
benchmarks/results/train_step_h200.json (or --out).
"""

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qerl.attention_masks import left_padding_mask, without_cudnn_attention  # noqa: E402
from qerl.logprobs import selective_log_softmax  # noqa: E402
from qerl.model import enable_activation_checkpointing  # noqa: E402
from qerl.quantize import base_weight_bytes  # noqa: E402
from qerl.rollout import SamplingSettings  # noqa: E402
from qerl.rollout.fast_linears import fused_base_projections  # noqa: E402
from qerl.rollout.hf import HFEngine  # noqa: E402
from rollout_hf import SHAPES, build as build_random  # noqa: E402

GB = 1024 ** 3


def build(shape: str, arm: str, device: str, lora_compute: str):
    """``rollout_hf.build``'s random model (LoRA r32, non-zero B) with gradient checkpointing, as QeRLModule."""
    model, vocab = build_random(shape, arm, device, lora_compute)
    enable_activation_checkpointing(model)
    return model, vocab


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def lora_update(model, vocab: int, batch: int, seq: int, device: str, fused: bool = False,
                projections: bool = False, cudnn: bool = True, left_pad: int = 0):
    """One LoRA update on ``batch x seq`` seeded tokens (a fresh AdamW), as a callable; ``fused``:
    forward and backward inside ``qerl.fused_ops.fused_ops`` (as ``QeRLModule(fused_ops: true)``);
    ``projections``: inside ``qerl.rollout.fast_linears.fused_base_projections``; ``cudnn`` False:
    inside ``without_cudnn_attention``; ``left_pad``: the rows left-padded (module docstring)."""
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (batch, seq), generator=g).to(device)              # (B, T)
    inputs = {"input_ids": ids[:, :-1]}
    if left_pad:
        pads = torch.tensor([i * left_pad // max(batch - 1, 1) for i in range(batch)], device=device)
        valid = torch.arange(seq - 1, device=device)[None, :] >= pads[:, None]      # (B, T-1)
        inputs["attention_mask"] = left_padding_mask(model, valid.long())
        inputs["position_ids"] = (valid.long().cumsum(-1) - 1).clamp(min=0)

    def block():
        stack = contextlib.ExitStack()
        if fused:
            from qerl.fused_ops import fused_ops
            stack.enter_context(fused_ops(model))
        if projections:
            stack.enter_context(fused_base_projections(model))
        if not cudnn:
            stack.enter_context(without_cudnn_attention())
        return stack

    def step():
        with block():
            logits = model(**inputs).logits                                            # (B, T-1, V)
            logp = selective_log_softmax(logits, ids[:, 1:])                           # (B, T-1)
            (-logp.mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


# What the caching allocator did during the timed updates (deltas; a cudaMalloc / cudaFree or a
# retry after freeing the cache inside an update would show here), to tell an allocator regime from
# a host one when the same update's time drifts between rounds.
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def host_cpu_mhz() -> float | None:
    """Mean current clock of the host's cores (Linux /proc/cpuinfo), None elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
    except OSError:
        return None
    return statistics.mean(mhz) if mhz else None


def train_steps(model, vocab: int, batch: int, seq: int, device: str, fused: bool = False,
                projections: bool = False, cudnn: bool = True, left_pad: int = 0,
                steps: int = 3) -> tuple[float, float, float, dict]:
    """(median seconds per update, median seconds the host took to enqueue it, peak GB allocated,
    context: the allocator's counters over the timed updates and the host's CPU clock after them).

    The host time is measured before the closing synchronize: when it is close to the update's
    time, Python (not the GPU) sets the pace."""
    step = lora_update(model, vocab, batch, seq, device, fused, projections, cudnn, left_pad)
    step()                                                                              # warm-up (tuning, compile)
    sync(device)
    before = {}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_stats()
    times, host = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
        sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / GB if device == "cuda" else float("nan")
    context = {"host_cpu_mhz": host_cpu_mhz()}
    if device == "cuda":
        after = torch.cuda.memory_stats()
        context.update({k: after.get(k, 0) - before.get(k, 0) for k in ALLOCATOR_COUNTERS})
        context["segments"] = after.get("segment.all.current", 0)
    return statistics.median(times), statistics.median(host), peak, context


TRAIN_CATEGORIES = [  # first match wins; kernel names of torch 2.11 / Triton 3.6 on the H200
    ("nvfp4 dequantize (Triton)", r"^_dequant_kernel"),
    ("nvfp4 fused (Triton / CUDA)", r"^_fwd_kernel|^_bwd_kernel|nvfp4_skinny|nvfp4_wgmma"),
    ("nf4 dequantize (bitsandbytes)", r"kDequantize|dequantize"),
    ("attention", r"flash|fmha|attention|sdpa|softmax_warp"),
    ("GEMM (linears, LoRA, lm_head)", r"gemm|gemv|cutlass|xmma|cublas|splitK|nvjet|sm90_"),
    ("reductions (norms, log-softmax, ...)", r"reduce|norm|softmax"),
    ("elementwise / copies", r"elementwise|vectorized|copy|fill|index|cat|where|unrolled|foreach"),
]


def profile_step(model, vocab: int, batch: int, seq: int, device: str, fused: bool = False,
                 projections: bool = False, cudnn: bool = True, left_pad: int = 0) -> list[dict]:
    """CUDA kernel time of one update (after ``train_steps``' warm-up) per category, ms."""
    from torch.profiler import ProfilerActivity, profile

    update = lora_update(model, vocab, batch, seq, device, fused, projections, cudnn, left_pad)
    update()                                                                            # AdamW state, allocations
    sync(device)
    activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        update()
        sync(device)
    per_cat, names = {}, {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", 0.0) if device == "cuda" else ev.self_cpu_time_total
        if t <= 0:
            continue
        cat = next((c for c, pat in TRAIN_CATEGORIES if re.search(pat, ev.key, re.I)), "other")
        per_cat[cat] = per_cat.get(cat, 0.0) + t / 1e3
        names.setdefault(cat, []).append((t / 1e3, ev.count, ev.key[:100]))
    return [{"category": c, "ms": ms, "top_kernels": [{"ms": a, "calls": n, "name": k} for a, n, k in sorted(names[c], reverse=True)[:4]]}
            for c, ms in sorted(per_cat.items(), key=lambda kv: -kv[1])]


def host_profile_step(model, vocab: int, batch: int, seq: int, device: str, fused: bool = False,
                      projections: bool = False, cudnn: bool = True, left_pad: int = 0, top: int = 15) -> list[dict]:
    """The Python functions that take the host's time in one update (cProfile, own time), ms."""
    import cProfile
    import pstats

    update = lora_update(model, vocab, batch, seq, device, fused, projections, cudnn, left_pad)
    update()
    sync(device)
    prof = cProfile.Profile()
    prof.enable()
    update()
    prof.disable()
    sync(device)
    stats = pstats.Stats(prof).stats              # (file, line, name) -> (calls, ncalls, own, cumulative, callers)
    rows = [{"function": f"{os.path.basename(f)}:{line}:{name}", "calls": nc, "own_ms": own * 1e3, "cum_ms": cum * 1e3}
            for (f, line, name), (_, nc, own, cum, _) in stats.items()]
    return sorted(rows, key=lambda r: -r["own_ms"])[:top]


def gen_tok_s(model, vocab: int, batch: int, prompt: int, new: int, device: str) -> float:
    model.eval()
    engine = HFEngine(stop_token_ids=[-1], pad_token_id=0, max_batch_size=batch)
    engine.sync(model)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, vocab, (batch, prompt), generator=g).tolist()
    sampling = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new)
    engine.generate(prompts, 1, sampling, seed=0)                                      # warm-up / capture
    seconds = []
    for seed in (1, 2, 3):                     # one call swung by 10-20% between runs: median of 3
        sync(device)
        t0 = time.perf_counter()
        engine.generate(prompts, 1, sampling, seed=seed)
        sync(device)
        seconds.append(time.perf_counter() - t0)
    return batch * new / statistics.median(seconds)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--arms", default="bf16,nf4,nvfp4")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--gen-batch", type=int, default=8)
    ap.add_argument("--gen-prompt", type=int, default=128)
    ap.add_argument("--gen-new", type=int, default=128)
    ap.add_argument("--lora-compute", default="model",
                    help="LoraSettings.compute_dtype values to run each arm with: model (bf16 matmuls), stored (peft's fp32)")
    ap.add_argument("--profile", action="store_true", help="also: kernel time per category of one update (torch.profiler)")
    ap.add_argument("--host-profile", action="store_true", help="also: the host's Python time of one update by function (cProfile)")
    ap.add_argument("--fused-ops", default="off", help="off, on or off,on: the update inside qerl.fused_ops "
                    "(Triton RMSNorm / rotary / SiLU-mul, forward and backward; CUDA only: a no-op on CPU)")
    ap.add_argument("--fused-projections", default="off", help="off, on or off,on: the update inside "
                    "qerl.rollout.fast_linears.fused_base_projections (q/k/v and gate/up bases as one linear each)")
    ap.add_argument("--rounds", type=int, default=1, help="time the fused settings this many times, interleaved "
                    "(every other round in reverse order); rows take the median (host-bound updates drift by 10-30%% "
                    "within a process)")
    ap.add_argument("--skip-gen", action="store_true", help="no generation throughput (gen_tok_s null)")
    ap.add_argument("--left-pad", type=int, default=0, help="left-pad the rows up to P tokens, fed with the trainer's mask")
    ap.add_argument("--cudnn-attention", default="on", help="on, off or on,off: SDPA's cuDNN backend allowed or not")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "train_step_h200.json"))
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if not 0 <= args.left_pad < args.seq - 1:
        ap.error(f"--left-pad must be in [0, seq - 1), got {args.left_pad}")
    if args.left_pad and args.batch < 2:
        ap.error("--left-pad needs --batch 2 or more (row 0 is never padded)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    on_off = lambda v: [{"off": False, "on": True}[s] for s in v.split(",")]  # noqa: E731
    fused_settings = [(f, p, c) for f in on_off(args.fused_ops) for p in on_off(args.fused_projections)
                      for c in on_off(args.cudnn_attention)]
    rows = []
    for arm, lora_compute in [(a, c) for c in args.lora_compute.split(",") for a in args.arms.split(",")]:
        try:
            model, vocab = build(args.shape, arm, device, lora_compute)
        except ImportError as e:                       # nf4 without bitsandbytes
            print(f"[train_step] skip {arm}: {e}")
            continue
        nbytes = base_weight_bytes(model)
        weights, linears = nbytes["total"] / GB, nbytes["decoder_linears"] / GB
        tok_s = None
        timed = {setting: [] for setting in fused_settings}
        for r in range(args.rounds):             # one model, the settings interleaved, every other round reversed
            for setting in (fused_settings if r % 2 == 0 else fused_settings[::-1]):
                timed[setting].append(train_steps(model, vocab, args.batch, args.seq, device, *setting, args.left_pad))
        for fused, proj, cudnn in fused_settings:  # the update with and without the fused ops / projections / cuDNN
            runs = timed[(fused, proj, cudnn)]
            step_s, host_s = (statistics.median(r[i] for r in runs) for i in (0, 1))
            peak = max(r[2] for r in runs)
            if tok_s is None and not args.skip_gen:
                tok_s = gen_tok_s(model, vocab, args.gen_batch, args.gen_prompt, args.gen_new, device)
            row = dict(arm=arm, lora_compute=lora_compute, fused_ops=fused, fused_projections=proj, cudnn_attention=cudnn,
                       left_pad=args.left_pad, weights_gb=weights, decoder_linears_gb=linears,
                       train_step_s=step_s, train_host_s=host_s, train_peak_gb=peak, gen_tok_s=tok_s,
                       round_step_s=[r[0] for r in runs], round_host_s=[r[1] for r in runs],
                       round_context=[r[3] for r in runs])
            rows.append(row)
            if args.profile:
                row["profile"] = profile_step(model, vocab, args.batch, args.seq, device, fused, proj, cudnn, args.left_pad)
                print(f"    kernels in all {sum(r['ms'] for r in row['profile']):8.2f} ms per update")
                for r in row["profile"]:
                    print(f"    {r['category']:38s} {r['ms']:8.2f} ms   e.g. {r['top_kernels'][0]['name'][:70]} x{r['top_kernels'][0]['calls']}")
            if args.host_profile:
                row["host_profile"] = host_profile_step(model, vocab, args.batch, args.seq, device, fused, proj, cudnn, args.left_pad)
                for r in row["host_profile"]:
                    print(f"    host {r['own_ms']:8.2f} ms own {r['cum_ms']:8.2f} ms cum x{r['calls']:<6d} {r['function'][:80]}")
            if len(runs) > 1:
                for i, (t, h, _, ctx) in enumerate(runs):
                    print(f"    round {i}: update {t:.3f} s host {h:.3f} s  " + " ".join(f"{k} {v}" for k, v in ctx.items()))
            print(f"{arm:6s} lora {lora_compute:6s} fused {str(fused):5s} proj {str(proj):5s} cudnn {str(cudnn):5s} weights {weights:6.2f} GB  update {step_s:7.3f} s "
                  f"(host {host_s:7.3f} s)  peak {peak:6.2f} GB  generate {tok_s or float('nan'):8.1f} tok/s", flush=True)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    keys = ("weights_gb", "train_step_s", "train_host_s", "train_peak_gb", "gen_tok_s")
    for r in rows:   # each arm against bf16 with the same LoRA arithmetic and fused ops; model vs stored; fused vs not
        same = lambda b, **kw: all(b[k] == kw.get(k, r[k]) for k in ("arm", "lora_compute", "fused_ops", "fused_projections", "cudnn_attention"))  # noqa: E731
        refs = {"vs_bf16": next((b for b in rows if same(b, arm="bf16")), None),
                "vs_stored": next((b for b in rows if same(b, lora_compute="stored")), None),
                "vs_unfused": next((b for b in rows if same(b, fused_ops=False)), None),
                "vs_unfused_projections": next((b for b in rows if same(b, fused_projections=False)), None),
                "vs_cudnn": next((b for b in rows if same(b, cudnn_attention=True)), None)}
        for name, ref in refs.items():
            if ref is not None:  # generation is measured once per model (it ignores lora_compute and the
                # fused training settings): only another arm has a generation ratio
                r[name] = {k: r[k] / ref[k] for k in keys if r[k] is not None and ref[k]
                           and (name == "vs_bf16" or k != "gen_tok_s")}
                print(f"{r['arm']} lora {r['lora_compute']} fused {r['fused_ops']} proj {r['fused_projections']} cudnn {r['cudnn_attention']} {name}: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in r[name].items()))
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "shape": args.shape, "rounds": args.rounds, "left_pad": args.left_pad, "command": " ".join(["python"] + sys.argv), "lora_rank": 32, "batch": args.batch, "seq": args.seq, "gradient_checkpointing": True,
            "gen": {"batch": args.gen_batch, "prompt": args.gen_prompt, "new": args.gen_new}}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
