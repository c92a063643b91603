"""Base-model accuracy of the three arms (bf16, nf4, nvfp4) without training: the "before" rows.

    python benchmarks/eval_base.py --model PATH.gguf --data data/gsm8k/test.jsonl [--arms bf16,nf4,nvfp4]
        [--limit N] [--max-new-tokens 1024] [--batch 1319] [--engine hf|vllm] [--append]
        [--out benchmarks/results/eval_base_h200.json]

Runs ``Trainer.validate`` on ``QeRLModule`` + ``PromptDataModule`` exactly as ``train.py validate``
does (greedy pass@1, math-verify, the default ``\\boxed{}`` system prompt, no adapter, no noise),
one arm after the other in one process, and records accuracy and wall time per arm. Built without
LightningCLI so it also runs where jsonargparse is not installed (the GPU image).

``--engine vllm`` evaluates through the colocated vLLM engine, as a run with ``RolloutCallback(engine:
vllm)`` does (NVFP4 arm: our compressed-tensors export on Marlin; bf16 and nf4 arms: a dense bf16
export of the same weights). Run one arm per process there (vLLM keeps process-wide state) with
``--append`` to collect the rows in one JSON.
"""

import argparse
import json
import os
import sys
import time

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_modules.data import PromptDataModule  # noqa: E402
from lightning_modules.evaluation import EvalSettings  # noqa: E402
from lightning_modules.qerl_module import QeRLModule  # noqa: E402


def evaluate(model: str, arm: str, data: str, limit, max_new_tokens: int, batch: int, log_dir: str,
             engine: str = "hf") -> dict:
    callbacks = []
    if engine == "vllm":
        from callbacks.rollout import RolloutCallback
        from qerl.rollout.vllm import VLLMSettings

        callbacks.append(RolloutCallback(engine="vllm", vllm=VLLMSettings(
            gpu_memory_utilization=0.5, max_model_len=1024 + max_new_tokens, export_dir=f"{log_dir}/export_{arm}")))
    module = QeRLModule(model=model, quantization=arm, dtype="bf16",
                        eval=EvalSettings(samples=0, max_new_tokens=max_new_tokens, use_adapter=False,
                                          max_batch_size=batch))
    dm = PromptDataModule(val_sources={"gsm8k": data}, num_val_examples=limit, val_prompts_per_batch=batch,
                          max_prompt_length=1024)
    logger = L.pytorch.loggers.CSVLogger(log_dir, name=arm)
    trainer = L.Trainer(accelerator="auto", devices=1, logger=logger, enable_progress_bar=False,
                        enable_checkpointing=False, callbacks=callbacks)
    t0 = time.perf_counter()
    trainer.validate(module, datamodule=dm)
    seconds = time.perf_counter() - t0
    report = json.load(open(os.path.join(trainer.log_dir, "eval", "val_step0.json")))
    m = report["metrics"]["gsm8k"]
    finished = [c["finish"] for c in report["completions"]["gsm8k"]]
    from qerl.quantize import base_weight_bytes

    return {"arm": arm, "dataset": "gsm8k-test", "problems": m["problems"], "pass@1": m["pass@1"],
            "wall_s": round(seconds, 1), "truncated_frac": finished.count("length") / max(1, len(finished)),
            "decoder_linear_bytes": base_weight_bytes(module.model)["decoder_linears"],
            "max_new_tokens": max_new_tokens, "engine": engine,
            **({"vllm_start_s": round(callbacks[0].engine.last_sync["start"], 1)} if callbacks else {})}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--arms", default="bf16,nf4,nvfp4")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1319)
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--append", action="store_true", help="keep the rows of other arms already in --out")
    ap.add_argument("--log-dir", default="logs/eval_base")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "eval_base_h200.json"))
    args = ap.parse_args()
    model_name = args.model
    if args.model.lower().endswith(".gguf"):
        # transformers dequantizes GGUF on the CPU (over a minute for 0.5B): do it once, write a
        # bf16 checkpoint, and let every arm load (and quantize) from that.
        from qerl.export import export_bf16
        from qerl.model import load_base_model

        dense = os.path.join(args.log_dir, "bf16_checkpoint")
        t0 = time.perf_counter()
        export_bf16(*load_base_model(args.model, dtype="bf16"), dense)
        print(f"GGUF -> bf16 checkpoint in {time.perf_counter() - t0:.1f} s", flush=True)
        args.model = dense
    arms = args.arms.split(",")
    rows = []
    if args.append and os.path.exists(args.out):
        rows = [r for r in json.load(open(args.out))["rows"] if r["arm"] not in arms]
    for arm in arms:
        rows.append(evaluate(args.model, arm, args.data, args.limit, args.max_new_tokens, args.batch, args.log_dir,
                             args.engine))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:  # after every arm: a timeout keeps what finished
            json.dump({"model": os.path.basename(model_name), "device": torch.cuda.get_device_name()
                       if torch.cuda.is_available() else "cpu", "rows": rows,
                       "meta": {"command": "python " + " ".join(sys.argv), "torch": torch.__version__,
                                "date": time.strftime("%Y-%m-%d"),
                                "notes": "greedy pass@1, math-verify, default \\boxed{} system prompt, no adapter, "
                                         "no AQN; engine hf = embedded (static cache + CUDA graphs on GPU), "
                                         "vllm = colocated vLLM (row 'engine')"}},
                      f, indent=1)
    print("\n| arm | pass@1 | problems | wall s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['arm']} | {100 * r['pass@1']:.1f}% | {r['problems']} | {r['wall_s']} |")


if __name__ == "__main__":
    main()
