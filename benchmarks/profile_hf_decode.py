"""Where one decode step of the embedded (hf) engine spends GPU time: kernel time per category.

    python benchmarks/profile_hf_decode.py [--quantization nvfp4|bf16] [--batch 1] [--new 16] [--static]

A Qwen2.5-7B-shaped model (random weights, LoRA r32 as in benchmarks/rollout_hf.py), B prompts of
256 tokens, ``--new`` tokens decoded eagerly (dynamic cache; ``--static``: the static cache and 4-D
masks of the engine's CUDA-graph mode, run eagerly, i.e. the kernels a graph replay runs) under
torch.profiler; CUDA kernel time is grouped by name into categories and divided by the number of
decoded tokens. Eager, so launch gaps are not counted, but the kernel time per category is what a
graph replay also spends; the wall time per token of the engine's default (graph) mode, same batch,
is printed next to it. Writes benchmarks/results/profile_hf_decode_h200.json.
"""

import argparse
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.rollout_hf import build  # noqa: E402
from qerl.rollout import SamplingSettings  # noqa: E402
from qerl.rollout.hf import HFEngine  # noqa: E402

CATEGORIES = [  # first match wins
    ("nvfp4 linear (CUDA skinny)", r"nvfp4_skinny"),
    ("attention", r"flash|fmha|attention|sdpa|softmax_warp"),
    ("nvfp4 linear (Triton)", r"^_fwd_kernel|^_dequant_kernel|^_bwd_kernel"),
    ("GEMM/GEMV (LoRA, lm_head, bf16 linears)", r"gemm|gemv|cutlass|xmma|cublas|splitK"),
    ("sort / top-p / sampling", r"sort|topk|radix|scan|multinomial|cumsum|distribution"),
    ("reductions (norms, ...)", r"reduce|norm"),
    ("elementwise / copies", r"elementwise|vectorized|copy|fill|index|cat|where|unrolled"),
]


def category(name: str) -> str:
    for cat, pat in CATEGORIES:
        if re.search(pat, name, re.I):
            return cat
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default="nvfp4")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--static", action="store_true", help="profile the static-cache decoder (graph mode's kernels)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "profile_hf_decode_h200.json"))
    args = ap.parse_args()
    model, vocab = build("7b", args.quantization, "cuda")
    engine = HFEngine(stop_token_ids=[-1], pad_token_id=0, max_batch_size=args.batch, cuda_graphs=False)
    engine.sync(model)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, vocab, (args.batch, 256), generator=g).tolist()
    sampling = SamplingSettings(1.0, 1.0, 0, args.new)
    engine.generate(prompts, 1, sampling, seed=0)                      # warm-up: compile, tune
    torch.cuda.synchronize()
    graph_engine = HFEngine(stop_token_ids=[-1], pad_token_id=0, max_batch_size=args.batch, cuda_graphs=True)
    graph_engine.sync(model)
    graph_engine.generate(prompts, 1, sampling, seed=0)
    wall = graph_engine.generate(prompts, 1, sampling, seed=1).timings["generate"]
    print(f"graph mode: {wall / args.new * 1e3:.2f} ms wall per decoded token (prefill included)")
    if args.static:
        engine.cuda_graphs = True                      # static cache + 4-D masks, but eager: no capture
        _chunk = engine._generate_chunk
        engine._generate_chunk = lambda p, s, g: _chunk(p, s, g, static=True)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, 1, sampling, seed=1)
        torch.cuda.synchronize()
    per_cat, names = {}, {}
    for ev in prof.key_averages():
        t = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        if t <= 0:
            continue
        c = category(ev.key)
        per_cat[c] = per_cat.get(c, 0.0) + t
        names.setdefault(c, []).append((t, ev.count, ev.key[:90]))
    tokens = args.new                                                 # prefill included: one step of it
    total = sum(per_cat.values())
    rows = []
    print(f"{args.quantization} B={args.batch}: {total / tokens / 1e3:.2f} ms of kernels per decoded token")
    for c, t in sorted(per_cat.items(), key=lambda kv: -kv[1]):
        top = sorted(names[c], reverse=True)[:3]
        rows.append({"category": c, "ms_per_token": t / tokens / 1e3, "share": t / total,
                     "top_kernels": [{"us_total": a, "calls": n, "name": k} for a, n, k in top]})
        print(f"  {c:42s} {t / tokens / 1e3:7.3f} ms/token  {100 * t / total:5.1f}%   e.g. {top[0][2][:60]}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": {"device": torch.cuda.get_device_name(), "quantization": args.quantization,
                            "batch": args.batch, "new_tokens": args.new, "prompt_tokens": 256,
                            "command": "python benchmarks/profile_hf_decode.py " + " ".join(sys.argv[1:]),
                            "decoder": "static cache (graph mode's kernels), eager" if args.static else "dynamic cache",
                            "graph_mode_wall_ms_per_token": wall / args.new * 1e3,
                            "note": "eager decode, kernel time only (prefill included, divided by new tokens)"},
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
