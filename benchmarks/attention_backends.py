"""What keeping SDPA's cuDNN backend out of the training step costs: attention forward + backward per backend.

    python benchmarks/attention_backends.py [--shape 7b|0.5b] [--batch 8] [--seqs 512,1024,2048] [--out PATH]

cuDNN's attention gave non-finite gradients on the H200 (results/nonfinite_hunt_h200.json); the trainer
recomputes such an update inside ``qerl.attention_masks.without_cudnn_attention`` (and runs every pass
there with ``model.cudnn_attention: false``): what that costs when it runs is measured here. This
times one layer's ``scaled_dot_product_attention`` forward + backward (bf16, K/V heads repeated as
transformers' sdpa path does, a left-padded boolean mask with each padding query seeing itself: the
trainer's mask) under each backend -- cuDNN, memory-efficient, math -- and ``flash`` on the same
tensors without a mask (causal; a batch without padding), CUDA events, median of 20 after warm-up.
Rows: ``{"shape", "B", "L", "backend", "ms", "vs_cudnn", "finite"}`` (``finite``: every gradient
finite). Also runs on CPU (math only, a smoke test). Writes benchmarks/results/attention_backends_h200.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qerl.attention_masks import padded_causal_mask  # noqa: E402

SHAPES = {"7b": (28, 4, 128), "0.5b": (14, 2, 64), "tiny": (4, 2, 16)}  # query heads, K/V heads, head dim
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH, "flash (no mask)": SDPBackend.FLASH_ATTENTION}


def inputs(shape: str, B: int, L: int, device: str, seed: int = 0):
    """q, k, v (B, H, L, D) bf16 with K/V repeated to H heads, the trainer's mask, padding up to L/4."""
    H, KV, D = SHAPES[shape]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=gen).to(device, torch.bfloat16)
    k, v = (torch.randn(B, KV, L, D, generator=gen).to(device, torch.bfloat16).repeat_interleave(H // KV, 1)
            for _ in range(2))
    pads = torch.randint(0, L // 4 + 1, (B,), generator=gen)
    valid = torch.arange(L)[None] >= pads[:, None]  # (B, L)
    grad_out = torch.randn(B, H, L, D, generator=gen).to(device, torch.bfloat16) * valid[:, None, :, None].to(device)
    return q, k, v, padded_causal_mask(valid).to(device), grad_out


def time_backend(name: str, q, k, v, mask, grad_out, iters: int = 20) -> tuple[float, bool] | None:
    """Median ms of forward + backward under backend ``name`` (None: the backend refuses these inputs)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    kwargs = {"is_causal": True} if name.startswith("flash") else {"attn_mask": mask}

    def once():
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        out.backward(grad_out)

    try:
        with sdpa_kernel([BACKENDS[name]]):
            once()
            if q.device.type != "cuda":
                return float("nan"), all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
            times = []
            for _ in range(iters):
                q.grad = k.grad = v.grad = None
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                once()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
    except RuntimeError:  # "No available kernel" for this backend and these inputs
        return None
    return statistics.median(times), all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqs", default="512,1024,2048")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "attention_backends_h200.json"))
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = list(BACKENDS) if device == "cuda" else ["math"]
    rows = []
    print("| shape | B | L | backend | ms | vs cudnn | finite |\n|---|---|---|---|---|---|---|")
    for L in (int(s) for s in args.seqs.split(",")):
        tensors = inputs(args.shape, args.batch, L, device)
        timed = {name: time_backend(name, *tensors) for name in names}
        base = timed.get("cudnn")
        for name, result in timed.items():
            if result is None:
                continue
            ms, finite = result
            ratio = ms / base[0] if base else None
            rows.append({"shape": args.shape, "B": args.batch, "L": L, "backend": name, "ms": ms,
                         "vs_cudnn": ratio, "finite": finite})
            print(f"| {args.shape} | {args.batch} | {L} | {name} | {ms:.3f} | "
                  f"{'' if ratio is None else f'{ratio:.2f}x'} | {finite} |")
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "command": "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:]))}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
