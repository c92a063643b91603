"""Padding in the training passes: what cutting and length-grouping the micro-batches save.

    python benchmarks/micro_batching.py [--shape small|7b|tiny] [--quantization bf16|nvfp4] [--n 64]
        [--prompt 128] [--new 512] [--micro 16] [--mean 300] [--std 110] [--out PATH]

A random Qwen2-shaped policy with LoRA r32 (``benchmarks/rollout_hf.py``'s ``build``; gradient
checkpointing as in the recipes) and a synthetic rollout batch of ``n`` completions shaped like the
testbed's GSM8K rollouts (results/fit_lora_compute_h200.json: completion length mean ~300, max 512
= ``max_new_tokens``): completion lengths ~ N(mean, std) clipped to [1, new], prompt lengths
uniform in [prompt / 2, prompt]. One update's work -- ``QeRLModule.completion_logprobs`` forward and
backward over every micro-batch -- timed (median of 3 after a warm-up) in three modes:

* ``padded``: rollout order, every micro-batch at the batch's full width (prompt + ``new`` columns),
  as the trainer ran before 2026-12-01 (``cut=False``);
* ``cut``: rollout order, each micro-batch cut to its own rows' longest prompt and completion;
* ``grouped``: sorted by completion length first (``LossSettings.group_by_length``, the default).

Rows: ``tokens`` (positions computed, padding included), ``seconds``, both relative to ``padded``.
Writes benchmarks/results/micro_batching_<device>.json (or --out).
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_modules.qerl_module import QeRLModule, forward_window  # noqa: E402
from qerl.model import enable_activation_checkpointing  # noqa: E402
from rollout_hf import build  # noqa: E402


def synthetic_rollout(n: int, prompt: int, new: int, mean: float, std: float, vocab: int, device: str):
    g = torch.Generator().manual_seed(0)
    c_len = (torch.randn(n, generator=g) * std + mean).round().clamp(1, new).long()           # (n,)
    p_len = torch.randint(prompt // 2, prompt + 1, (n,), generator=g)                         # (n,)
    prompt_mask = (torch.arange(prompt)[None] >= prompt - p_len[:, None]).long()              # (n, P) left-padded
    completion_mask = (torch.arange(new)[None] < c_len[:, None]).long()                       # (n, T) right-padded
    prompt_ids = torch.randint(1, vocab, (n, prompt), generator=g) * prompt_mask
    completion_ids = torch.randint(1, vocab, (n, new), generator=g) * completion_mask
    to = lambda t: t.to(device)  # noqa: E731
    return (to(torch.cat([prompt_ids, completion_ids], 1)), to(torch.cat([prompt_mask, completion_mask], 1)),
            to(completion_ids), to(completion_mask), c_len)


def one_update(module, input_ids, attention_mask, completion_ids, completion_mask, rows, micro: int, cut: bool) -> int:
    """Forward + backward over the micro-batches of ``rows``; returns the positions computed."""
    tokens, P = 0, input_ids.shape[1] - completion_ids.shape[1]
    count = completion_mask.sum()
    for i in range(0, len(rows), micro):
        mb = rows[i: i + micro]
        logprobs, _ = module.completion_logprobs(input_ids[mb], attention_mask[mb], completion_ids[mb], 1.0, cut=cut)
        (-(logprobs * completion_mask[mb]).sum() / count).backward()                          # a dapo-like token mean
        start, stop = forward_window(attention_mask[mb], P) if cut else (0, input_ids.shape[1])
        tokens += len(mb) * (stop - start - (stop > P))                    # (the last column is never fed)
    return tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default=None, help="default: 7b on CUDA, small on CPU")
    ap.add_argument("--quantization", default=None, help="default: nvfp4 on CUDA, bf16 on CPU")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--mean", type=float, default=300.0)
    ap.add_argument("--std", type=float, default=110.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = args.shape or ("7b" if device == "cuda" else "small")
    quantization = args.quantization or ("nvfp4" if device == "cuda" else "bf16")
    model, vocab = build(shape, quantization, device)
    enable_activation_checkpointing(model)
    model.train()
    module = QeRLModule(model="tiny-qwen2", quantization=quantization)   # completion_logprobs on this model
    module.model = model
    input_ids, attention_mask, completion_ids, completion_mask, c_len = synthetic_rollout(
        args.n, args.prompt, args.new, args.mean, args.std, vocab, device)
    in_order = torch.arange(args.n)
    grouped = torch.argsort(c_len, stable=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for mode, order, cut in (("padded", in_order, False), ("cut", in_order, True), ("grouped", grouped, True)):
        one_update(module, input_ids, attention_mask, completion_ids, completion_mask, order, args.micro, cut)  # warm-up
        seconds = []
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            tokens = one_update(module, input_ids, attention_mask, completion_ids, completion_mask, order, args.micro, cut)
            sync()
            seconds.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        rows.append({"mode": mode, "tokens": tokens, "seconds": statistics.median(seconds)})
    base = rows[0]
    for r in rows:
        r["vs_padded"] = {"tokens": r["tokens"] / base["tokens"], "seconds": r["seconds"] / base["seconds"]}
        print(f"{r['mode']:8s} tokens {r['tokens']:8d} ({r['vs_padded']['tokens']:.2f}x)  "
              f"{r['seconds']:7.3f} s ({r['vs_padded']['seconds']:.2f}x)", flush=True)
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "shape": shape, "quantization": quantization, "lora_rank": 32, "gradient_checkpointing": True,
            "n": args.n, "prompt": args.prompt, "new": args.new, "micro_batch_size": args.micro,
            "completion_length": {"mean": float(c_len.float().mean()), "max": int(c_len.max()),
                                  "at_max": int((c_len == args.new).sum())},
            "command": "python benchmarks/micro_batching.py " + " ".join(sys.argv[1:])}
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"micro_batching_{'h200' if device == 'cuda' else 'cpu'}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
