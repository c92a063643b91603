"""What the embedded engine's per-token sampling costs: torch.multinomial vs seeded inverse-CDF.

    python benchmarks/sampler.py [--batches 1,8,64] [--vocab 152064] [--out PATH]

The embedded engine draws each completion's tokens from its own pre-drawn uniforms
(``qerl.rollout.base.sample_inverse_cdf``: a float64 cumulative sum and a binary search per row, plus
the non-finite check on the drawn tokens' log-probs that the engine folds into its stop check) so that a prompt's samples do not depend
on the rows decoded beside it. This times that per-token work against the ``torch.multinomial`` draw
it replaced, side by side on the same logits (fp32, Qwen2.5's vocabulary, temperature 1, top-p 1),
CUDA-event median over ``--iters`` tokens. Writes benchmarks/results/sampler_<device>.json.
"""

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qerl.rollout.base import sample_inverse_cdf  # noqa: E402


def timed(fn, iters: int) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls (CUDA events; wall clock on CPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            import time
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        logits = 4 * torch.randn(batch, args.vocab, device=device)  # (B, V), peaked like a model's
        gen = torch.Generator(device=device).manual_seed(0)
        uniforms = torch.rand(batch, device=device, dtype=torch.float64)
        flag = torch.zeros((), dtype=torch.bool, device=device)

        def multinomial():
            logp = F.log_softmax(logits, dim=-1)
            return torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1), logp

        def inverse_cdf():
            logp = F.log_softmax(logits, dim=-1)
            nxt = sample_inverse_cdf(logp.exp(), uniforms)
            flag.logical_or_(logp.gather(-1, nxt[:, None]).isnan().any())
            return nxt, logp

        row = {"B": batch, "V": args.vocab, "multinomial_ms": timed(multinomial, args.iters),
               "inverse_cdf_ms": timed(inverse_cdf, args.iters)}
        row["ratio"] = row["inverse_cdf_ms"] / row["multinomial_ms"]
        rows.append(row)
        print(f"B={batch:4d}  multinomial {row['multinomial_ms']:.4f} ms  inverse-CDF {row['inverse_cdf_ms']:.4f} ms"
              f"  ({row['ratio']:.2f}x)")
    name = torch.cuda.get_device_name().split()[-1].lower() if device == "cuda" else "cpu"
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"sampler_{name}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                   "torch": torch.__version__, "command": " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
