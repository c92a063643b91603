"""Where one embedded-engine ``generate`` call spends its wall time, CUDA-graph mode.

    python benchmarks/generate_phases.py [--quantizations bf16,nvfp4] [--batch 8] [--lengths 128,256] [--out PATH]

A Qwen2.5-7B-shaped model (random weights, LoRA r32, as ``benchmarks/rollout_hf.py``), ``--batch``
prompts of P tokens and P new tokens for each P in ``--lengths``. The static decoder's constructor
(prefill into the static cache) and every decode step are timed with a device sync around them
(so the host loop does not overlap the GPU here, unlike a normal call): step 1 runs eagerly
(warm-up), step 2 captures the CUDA graph and replays it, the rest replay. Prints, per call:
wall, prefill, the first two steps and the median replayed step, and writes
benchmarks/results/generate_phases_h200.json. What it answers: the fixed cost each call (each
chunk of ``max_batch_size`` rows) pays before the per-token rate applies.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.rollout_hf import build  # noqa: E402
from qerl.rollout import SamplingSettings  # noqa: E402
import qerl.rollout.hf as hf  # noqa: E402


def synced(fn, record: list):
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        record.append(time.perf_counter() - t0)
        return out
    return wrapper


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantizations", default="bf16,nvfp4")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lengths", default="128,256")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "generate_phases_h200.json"))
    args = ap.parse_args()
    prefill, steps = [], []
    hf._StaticDecoder.__init__ = synced(hf._StaticDecoder.__init__, prefill)
    hf._StaticDecoder.step = synced(hf._StaticDecoder.step, steps)
    rows = []
    for quantization in args.quantizations.split(","):
        model, vocab = build("7b", quantization, "cuda")
        for P in [int(x) for x in args.lengths.split(",")]:
            engine = hf.HFEngine(stop_token_ids=[-1], pad_token_id=0, max_batch_size=args.batch)
            engine.sync(model)
            prompts = torch.randint(1, vocab, (args.batch, P), generator=torch.Generator().manual_seed(0)).tolist()
            engine.generate(prompts, 1, SamplingSettings(1.0, 1.0, 0, 8), seed=0)     # compile, tune, share storage
            for rep in range(2):
                prefill.clear()
                steps.clear()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.generate(prompts, 1, SamplingSettings(1.0, 1.0, 0, P), seed=1 + rep)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
                row = dict(quantization=quantization, B=args.batch, prompt=P, new=P, rep=rep, wall_s=wall,
                           tok_s=args.batch * P / wall, prefill_ms=1e3 * prefill[0], warmup_step_ms=1e3 * steps[0],
                           capture_step_ms=1e3 * steps[1], replay_step_ms=1e3 * statistics.median(steps[2:]))
                rows.append(row)
                print(f"{quantization:6s} B={args.batch} P=N={P} rep{rep}: wall {wall:.3f} s ({row['tok_s']:.0f} tok/s)  "
                      f"prefill {row['prefill_ms']:.1f} ms  warm-up step {row['warmup_step_ms']:.1f} ms  "
                      f"capture step {row['capture_step_ms']:.1f} ms  replayed step {row['replay_step_ms']:.2f} ms", flush=True)
        del model
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "command": "python benchmarks/generate_phases.py " + " ".join(sys.argv[1:]),
            "note": "steps synced one by one (the host loop does not overlap the GPU): wall is above a normal call's"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
