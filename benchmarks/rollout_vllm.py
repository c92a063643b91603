"""Colocated vLLM rollout throughput: our NVFP4 export (Marlin W4A16) vs bf16, with and without LoRA.

    python benchmarks/rollout_vllm.py [--shape 7b|tiny] [--batches 1,8,64] [--prompt 256] [--new 256]
        [--arms nvfp4,bf16] [--out benchmarks/results/rollout_vllm_h200.json]

The same Qwen2.5-7B-shaped random model as ``benchmarks/rollout_hf.py`` (std 0.02, LoRA r32 on
every decoder linear with a non-zero B), handed to ``VLLMEngine`` exactly as in training: ``sync``
exports the base (compressed-tensors NVFP4A16 for the nvfp4 arm, dense bf16 for the bf16 arm),
starts vLLM with sleep mode and pushes the adapter from memory. For each batch size B: B random
prompts of ``--prompt`` tokens, ``--new`` tokens each (``ignore_eos``, so every row decodes the
full length), a warm-up call, then the timed one; ``lora: true`` runs the requests with the
adapter, ``lora: false`` without it on the same (LoRA-enabled) engine. tok/s = B * new / seconds
(generated tokens; prefill included: the warm-up runs other prompts and the prefix cache is reset
before the timed call, so no timed prompt is served from vLLM's prefix cache). Each arm runs in its own process (a fresh vLLM), so the
numbers are side by side in one run. Also records the first sync (export + start), a per-step
sync (adapter push), and sleep / wake times.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def run_arm(arm: str, shape: str, batches: list[int], prompt: int, new: int, util: float) -> dict:
    from rollout_hf import build
    from vllm import SamplingParams

    from qerl.rollout.vllm import VLLMEngine, VLLMSettings

    model, vocab = build(shape, arm, "cuda")
    engine = VLLMEngine([], VLLMSettings(gpu_memory_utilization=util, max_model_len=prompt + new + 16,
                                         llm_kwargs={"max_num_seqs": max(batches),  # CUDA graphs for the timed sizes only: a quicker start
                                                     "compilation_config": {"cudagraph_capture_sizes": sorted(set(batches))}}),
                         seed=0)
    t0 = time.perf_counter()
    engine.sync(model)
    first_sync = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.sync(model)  # what every training step pays: wake the weights, push the adapter
    step_sync = time.perf_counter() - t0
    engine.wake()
    rows = []
    for b in batches:
        g = torch.Generator().manual_seed(b)
        prompts, warm_prompts = ([{"prompt_token_ids": p} for p in torch.randint(1, vocab, (b, prompt), generator=g).tolist()]
                                 for _ in range(2))
        params = SamplingParams(n=1, temperature=1.0, max_tokens=new, min_tokens=new, ignore_eos=True, logprobs=0,
                                detokenize=False, seed=b)
        for lora in (True, False):
            req = engine._lora_request if lora else None
            engine.llm.generate(warm_prompts, params, lora_request=req, use_tqdm=False)  # warm-up
            engine.llm.reset_prefix_cache()  # (the warm-up's prompts differ too: nothing timed is a cache hit)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = engine.llm.generate(prompts, params, lora_request=req, use_tqdm=False)
            seconds = time.perf_counter() - t0
            assert all(len(o.outputs[0].token_ids) == new for o in outs)
            rows.append({"quantization": arm, "B": b, "lora": lora, "tok_s": round(b * new / seconds, 1),
                         "shape": shape, "prompt_tokens": prompt, "new_tokens": new})
            print(json.dumps(rows[-1]), flush=True)
    t0 = time.perf_counter()
    engine.sleep()
    sleep_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.wake()
    wake_s = time.perf_counter() - t0
    export_bytes = sum(f.stat().st_size for f in engine.export_dir.glob("*.safetensors"))
    timing = {"quantization": arm, "first_sync_s": round(first_sync, 1), "step_sync_s": round(step_sync, 3),
              "sleep_s": round(sleep_s, 2), "wake_s": round(wake_s, 2), "export_bytes": export_bytes}
    return {"rows": rows, "timing": timing}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="7b")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--arms", default="nvfp4,bf16")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # internal: run one arm, print its JSON last
    ap.add_argument("--out", default=os.path.join(HERE, "results", "rollout_vllm_h200.json"))
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    if args.arm:
        result = run_arm(args.arm, args.shape, batches, args.prompt, args.new, args.gpu_memory_utilization)
        print("RESULT " + json.dumps(result), flush=True)
        return
    rows, timings, errors = [], [], {}
    for arm in args.arms.split(","):
        cmd = [sys.executable, __file__, "--arm", arm, *sys.argv[1:]]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        sys.stdout.write(proc.stdout)
        found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not found:
            errors[arm] = f"exit code {proc.returncode}"
            continue
        result = json.loads(found[-1][len("RESULT "):])
        rows += result["rows"]
        timings.append(result["timing"])
    by = {(r["quantization"], r["B"], r["lora"]): r["tok_s"] for r in rows}
    print("\n|  B | LoRA | bf16 tok/s | nvfp4 tok/s | nvfp4/bf16 |\n|---|---|---|---|---|")
    for b in batches:
        for lora in (True, False):
            bf, fp = by.get(("bf16", b, lora)), by.get(("nvfp4", b, lora))
            ratio = f"{fp / bf:.2f}" if bf and fp else "-"
            print(f"| {b} | {lora} | {bf} | {fp} | {ratio} |")
    import vllm  # noqa: F401  (version only; the arms ran in their own processes)

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "vllm": vllm.__version__,
            "command": "python benchmarks/rollout_vllm.py " + " ".join(sys.argv[1:])}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows, "timings": timings, "errors": errors}, f, indent=1)


if __name__ == "__main__":
    main()
