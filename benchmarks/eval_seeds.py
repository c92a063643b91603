"""Does a sampled evaluation draw the same completions at any evaluation batch size?

    python benchmarks/eval_seeds.py [--engine vllm|hf] [--batches 8,3] [--samples 4] [--dtype bf16|fp32]
        [--accelerator gpu|cpu]   (default: gpu when CUDA is there; vllm needs it)

Runs ``python train.py validate`` on the quickstart config (its tiny model, in ``--dtype``: bf16 by
default, which vLLM needs to serve its 64-wide layers) once per ``data.val_prompts_per_batch`` in
``--batches``, each in its own process (vLLM allows one instance per process), with
``model.eval.samples`` sampled completions per problem; records every sampled completion by wrapping
the engine's ``generate`` and compares them per problem across the runs (problem i draws from
``(eval.seed, set, i)``, see ``lightning_modules/evaluation.py``). Prints how many problems drew
identical samples token for token and writes benchmarks/results/eval_seeds_<engine>.json.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def config(engine: str, accelerator: str, dtype: str, path: str) -> str:
    cfg = yaml.safe_load(open(os.path.join(ROOT, "configs", "quickstart.yaml")))
    cfg["trainer"].update(accelerator=accelerator, logger=False, enable_progress_bar=False)
    cfg["model"].update(quantization="bf16", dtype=dtype)
    for cb in cfg["trainer"]["callbacks"]:
        if cb["class_path"].endswith("RolloutCallback") and engine == "vllm":
            cb["init_args"].update(engine="vllm", vllm={"gpu_memory_utilization": 0.2, "max_model_len": 512})
    yaml.safe_dump(cfg, open(path, "w"))
    return path


def record_samples(engine: str, cfg: str, batch: int, samples: int, max_new_tokens: int, dump: str) -> None:
    """One ``validate`` (its own process: vLLM allows one instance per process), its sampled completions
    per prompt written to ``dump`` as JSON pairs [prompt ids, completions]."""
    from qerl.rollout.hf import HFEngine
    import train

    engine_cls = HFEngine
    if engine == "vllm":
        from qerl.rollout.vllm import VLLMEngine as engine_cls
    sampled, original = {}, engine_cls.generate

    def generate(self, prompt_ids, n, sampling, seed):
        out = original(self, prompt_ids, n, sampling, seed)
        if sampling.temperature > 0:  # the sampled call: per prompt its n completions
            for i, p in enumerate(prompt_ids):
                sampled[tuple(p)] = [list(c) for c in out.completion_ids[i * n: (i + 1) * n]]
        return out

    engine_cls.generate = generate
    train.main(["validate", "--config", cfg, "--data.val_prompts_per_batch", str(batch),
                "--model.eval.samples", str(samples), "--model.eval.max_new_tokens", str(max_new_tokens)])
    json.dump([[list(p), c] for p, c in sampled.items()], open(dump, "w"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--batches", default="8,3")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--accelerator", default=None, choices=["gpu", "cpu"], help="default: gpu when CUDA is there")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", nargs=3, metavar=("CONFIG", "BATCH", "DUMP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.accelerator is None:
        import torch

        args.accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if args.child:
        cfg, batch, dump = args.child
        return record_samples(args.engine, cfg, int(batch), args.samples, args.max_new_tokens, dump)
    work = tempfile.mkdtemp()
    cfg = config(args.engine, args.accelerator, args.dtype, os.path.join(work, "config.yaml"))
    runs = []
    for batch in [int(b) for b in args.batches.split(",")]:
        dump = os.path.join(work, f"samples_{batch}.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--engine", args.engine, "--samples", str(args.samples),
                        "--max-new-tokens", str(args.max_new_tokens), "--child", cfg, str(batch), dump],
                       cwd=work, check=True)
        runs.append({"val_prompts_per_batch": batch, "samples": {tuple(p): c for p, c in json.load(open(dump))}})
    first = runs[0]["samples"]
    rows = []
    for run in runs[1:]:
        same = sum(run["samples"].get(p) == c for p, c in first.items())
        tokens = sum(len(x) for c in first.values() for x in c)
        rows.append({"dtype": args.dtype, "batches": [runs[0]["val_prompts_per_batch"], run["val_prompts_per_batch"]],
                     "problems": len(first), "identical_problems": same, "sampled_tokens": tokens})
        print(f"engine {args.engine}, {args.dtype}: val_prompts_per_batch {rows[-1]['batches']}: {same} of {len(first)} "
              f"problems drew identical samples ({args.samples} x up to {args.max_new_tokens} tokens each)")
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"eval_seeds_{args.engine}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    json.dump({"command": " ".join(["python", "benchmarks/eval_seeds.py", *sys.argv[1:]]), "rows": rows},
              open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
