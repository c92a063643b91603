"""Embedded (hf) rollout engine throughput: NVFP4 (Triton W4A16 kernels) vs bf16, same engine.

    python benchmarks/rollout_hf.py [--shape 7b|tiny] [--batches 1,8,64] [--prompt 256] [--new 256]
        [--modes graph,eager] [--variants default,sync_every_token,no_fused_projections,no_fused_ops,baseline]

A Qwen2.5-7B-shaped model with random weights (std 0.02) and LoRA r32 on every decoder linear, as
during RL. For each batch size B: B random prompts of ``--prompt`` tokens, ``--new`` sampled tokens
each (no stop token, so every row decodes the full length), one warm-up generation, then the timed
one. tok/s = B * new / seconds (generated tokens only; prefill and, for ``graph``, the per-call
CUDA-graph capture included). ``graph``: the engine's default on CUDA (static KV cache, decode step
replayed as a CUDA graph); ``eager``: ``cuda_graphs=False`` (dynamic cache, one eager forward per token).
``--variants`` A/B the engine's own speed-ups in one run: ``default``; ``sync_every_token`` (the
host reads "all rows stopped?" after every token instead of every ``STOP_CHECK_EVERY``);
``no_fused_projections`` (q, k, v, gate and up as separate linears); ``no_fused_ops`` (that, and
eager RMSNorm / rotary / SiLU-mul); ``baseline`` (that, and transformers' GQA attention path).
The first timed run of a process used to come out up to 30% slow (clocks, lazy initialisation):
one untimed spin-up run precedes them.
Prints a table and writes benchmarks/results/rollout_hf_h200.json (or --out).
"""

import argparse
import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qerl.model import LoraSettings, add_lora  # noqa: E402
from qerl.quantize import quantize_decoder_linears, quantize_decoder_linears_nf4  # noqa: E402
from qerl.rollout import SamplingSettings  # noqa: E402
from qerl.rollout.hf import HFEngine  # noqa: E402

SHAPES = {
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),    # Qwen2.5-0.5B: the testbed recipes' model
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=8192),      # CPU-sized (benchmarks/micro_batching.py)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}


def build(shape: str, quantization: str, device: str, lora_compute: str = "model"):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.02) if p.dim() == 2 else None
    if quantization == "nvfp4":
        quantize_decoder_linears(model, device)
    elif quantization == "nf4":  # QLoRA (bitsandbytes), for benchmarks/train_step.py
        quantize_decoder_linears_nf4(model, device)
    model = add_lora(model, LoraSettings(rank=32, alpha=32, compute_dtype=lora_compute))
    with torch.no_grad():  # a non-zero adapter, as after a few RL steps
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=1e-3)
    return model.eval(), config.vocab_size


VARIANTS = {  # --variants entry: (HFEngine switches, qerl.rollout.hf attributes swapped for the run)
    "default": ({}, {}),
    "sync_every_token": ({}, {"STOP_CHECK_EVERY": 1}),
    "no_fused_projections": (dict(fused_projections=False), {}),
    "no_fused_ops": (dict(fused_projections=False, fused_ops=False), {}),
    "baseline": (dict(fused_projections=False, fused_ops=False), {"packed_gqa_decode_attention": contextlib.nullcontext}),
}


def bench(model, vocab: int, batch: int, prompt: int, new: int, device: str, cuda_graphs: bool, **engine_args) -> float:
    engine = HFEngine(stop_token_ids=[-1], pad_token_id=0, max_batch_size=batch, cuda_graphs=cuda_graphs,
                      **engine_args)
    engine.sync(model)
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(1, vocab, (batch, prompt), generator=g).tolist()
    engine.generate(prompts, 1, SamplingSettings(1.0, 1.0, 0, 8), seed=0)  # warm-up (kernels, autotune)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = engine.generate(prompts, 1, SamplingSettings(1.0, 1.0, 0, new), seed=1)
    sync()
    seconds = time.perf_counter() - t0
    assert all(len(c) == new for c in out.completion_ids)
    return batch * new / seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--modes", default="graph,eager", help="graph: static cache + CUDA graph; eager: dynamic cache")
    ap.add_argument("--variants", default="default",
                    help="A/B of the engine, comma-separated: " + ", ".join(VARIANTS) + " (see above)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "rollout_hf_h200.json"))
    args = ap.parse_args()
    import qerl.rollout.hf as hf

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    batches = [int(x) for x in args.batches.split(",")]
    for quantization in ("bf16", "nvfp4"):
        model, vocab = build(args.shape, quantization, device)
        if not rows:   # spin-up, untimed
            bench(model, vocab, batches[0], args.prompt, args.new, device, cuda_graphs="graph" in args.modes)
        for mode in args.modes.split(","):
            for variant in args.variants.split(","):
                engine_args, swaps = VARIANTS[variant]
                saved = {k: getattr(hf, k) for k in swaps}
                for k, v in swaps.items():
                    setattr(hf, k, v)
                for b in batches:
                    tok_s = bench(model, vocab, b, args.prompt, args.new, device, cuda_graphs=mode == "graph",
                                  **engine_args)
                    rows.append({"quantization": quantization, "B": b, "lora": True, "decode": mode,
                                 "engine": variant, "shape": args.shape, "prompt_tokens": args.prompt,
                                 "new_tokens": args.new, "tok_s": round(tok_s, 1)})
                    print(f"{quantization:6s} {mode:5s} {variant:12s} B={b:3d}  {tok_s:9.1f} tok/s", flush=True)
                for k, v in saved.items():
                    setattr(hf, k, v)
        del model
        torch.cuda.empty_cache() if device == "cuda" else None
    by = {(r["quantization"], r["decode"], r["engine"], r["B"]): r["tok_s"] for r in rows}
    print("\n| decode | engine | B | bf16 tok/s | nvfp4 tok/s | nvfp4/bf16 |\n|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        for variant in args.variants.split(","):
            for b in sorted({r["B"] for r in rows}):
                bf, fp = by[("bf16", mode, variant, b)], by[("nvfp4", mode, variant, b)]
                print(f"| {mode} | {variant} | {b} | {bf:.1f} | {fp:.1f} | {fp / bf:.2f} |")
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "command": "python benchmarks/rollout_hf.py " + " ".join(sys.argv[1:])}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
