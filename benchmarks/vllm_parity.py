"""Does the colocated vLLM engine roll out the policy the trainer trains? Issue #6's checks (H200).

    python benchmarks/vllm_parity.py --model PATH(.gguf|dir) --data data/gsm8k/test.jsonl
        [--prompts 16] [--samples 4] [--sigma 0.01] [--out benchmarks/results/vllm_parity_h200.json]

The policy is the trainer's: the base loaded and quantized to NVFP4 (our Triton kernels), LoRA r32
on every decoder linear with B drawn at random (std ``--lora-std``) so the adapter changes the
outputs, as after some RL steps. ``VLLMEngine`` (``qerl/rollout/vllm.py``) exports it, starts vLLM
and pushes the adapter from memory, exactly as ``engine: vllm`` does in training. Then:

1. **load**: vLLM's linear kernel (Marlin on sm_90) and the export's size.
2. **greedy**: ``--greedy-tokens`` greedy tokens per prompt from vLLM and from the trainer's own
   greedy decode (the HF engine on the same policy); per prompt the length of the common prefix.
3. **sampled log-probs**: T = 1 completions from vLLM; their sampler log-probs against the
   trainer's teacher-forced log-probs of the same tokens: mean / p99 / max |Δ|. vLLM has slept and
   woken since the sync (after step 2), so this also shows the adapter survives a level-1 sleep,
   which DAPO's refill rounds rely on (they generate again without a sync). Then again at
   ``--temperature`` / ``--top-p`` (0.7 / 0.95): vLLM's processed log-probs against the trainer's of
   the same tempered, nucleus-filtered distribution (``filter_logits``, as the embedded engine samples).
4. **adapter live**: one Adam step on the LoRA weights; vLLM's log-probs of the same tokens (scored
   as prompt log-probs) before and after the next ``sync``, against the trainer's new ones.
5. **AQN**: noise of std ``--sigma`` on the norms; vLLM (synced with the noisy scales) against the
   trainer's noisy and clean forwards; again with ``scale_precision="bf16"`` (stochastic rounding
   in the trainer, so the scales vLLM holds in bf16 are exactly the trainer's).
6. **sleep**: free GPU memory awake vs asleep (the KV cache and the weights are released).

Prints a summary, writes the JSON with every number and the tolerances it checks (``checks``;
exit status 1 when one fails): greedy identical on >= 1/2 of the prompts and every divergence a
near tie of the trainer's top-2 (< 0.5 nats); sampled mean |Δ log-prob| <= 0.05 (p99 <= 0.5), at both
temperatures (at top-p <= 1% of the tokens outside the trainer's nucleus);
after a sync the adapter's log-probs within 0.05 of the trainer's; with AQN vLLM closer to the
trainer's noisy than its clean forward, bf16 scales copied exactly; sleep frees >= 1 GiB. The
GPU test ``tests/test_vllm_engine.py::test_vllm_logprobs_match_the_trainer_gpu`` asserts the
log-prob tolerance on a tiny model.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qerl.aqn import attach_noisy_norms  # noqa: E402
from qerl.data import DEFAULT_SYSTEM_PROMPT, build_prompt_ids, load_examples  # noqa: E402
from qerl.model import LoraSettings, load_policy  # noqa: E402
from qerl.rollout import SamplingSettings, stop_token_ids  # noqa: E402
from qerl.rollout.hf import HFEngine, filter_logits  # noqa: E402
from qerl.rollout.vllm import VLLMEngine, VLLMSettings  # noqa: E402


def trainer_logprobs(model, prompts: list[list[int]], completions: list[list[int]], grad: bool = False,
                     sampling: SamplingSettings | None = None):
    """Teacher-forced log-probs of each completion token, one unpadded sequence at a time; with
    ``sampling``, of the distribution it samples from (logits / T, top-k / top-p set renormalised),
    which is what vLLM's ``processed_logprobs`` and the embedded engine return."""
    out = []
    with torch.set_grad_enabled(grad):
        for p, c in zip(prompts, completions):
            ids = torch.tensor([p + c], device="cuda")
            logits = model(input_ids=ids).logits[0, len(p) - 1: -1].float()  # (T, V)
            if sampling is not None:
                logits = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, len(p):, None])[:, 0])
    return out


def vllm_scores(engine: VLLMEngine, prompts, completions) -> list[torch.Tensor]:
    """vLLM's log-probs of given completions under its current adapter and norms (prompt log-probs)."""
    from vllm import SamplingParams

    engine.wake()
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    reqs = [{"prompt_token_ids": p + c} for p, c in zip(prompts, completions)]
    outs = engine.llm.generate(reqs, params, lora_request=engine._lora_request, use_tqdm=False)
    engine.sleep()
    scores = []
    for o, p, c in zip(outs, prompts, completions):
        rows = o.prompt_logprobs[len(p):]
        scores.append(torch.tensor([row[t].logprob for row, t in zip(rows, c)]))
    return scores


def abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    d = torch.cat([(x.detach().float().cpu() - y.detach().float().cpu()).abs() for x, y in zip(a, b)])
    return {"mean": d.mean().item(), "p99": d.quantile(0.99).item(), "max": d.max().item(), "tokens": d.numel()}


def linear_kernel(engine: VLLMEngine) -> str:
    def probe(model):
        for name, m in model.named_modules():
            scheme = getattr(m, "scheme", None)  # compressed-tensors keeps its scheme on the layer
            if scheme is not None:
                return f"{name}: {type(scheme).__name__} / {type(getattr(scheme, 'kernel', None)).__name__}"
        return "no quantized linear found"

    engine.wake()
    try:
        return engine.llm.apply_model(probe)[0]
    finally:
        engine.sleep()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--sample-tokens", type=int, default=128)
    ap.add_argument("--lora-std", type=float, default=2e-3)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--sigma", type=float, default=1e-2)
    ap.add_argument("--quantization", default="nvfp4", choices=["nvfp4", "bf16"],
                    help="the frozen base (bf16: the 16-bit LoRA baseline, a reference for the gap NVFP4 adds)")
    ap.add_argument("--temperature", type=float, default=0.7, help="the second sampled check's temperature")
    ap.add_argument("--top-p", type=float, default=0.95, help="the second sampled check's nucleus mass")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "vllm_parity_h200.json"))
    args = ap.parse_args()
    res: dict = {"model": os.path.basename(args.model), "device": torch.cuda.get_device_name(), "args": vars(args)}

    def save():
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    t0 = time.perf_counter()
    model, tok = load_policy(args.model, args.quantization, LoraSettings(rank=32, alpha=32), dtype="bf16", device="cuda")
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=args.lora_std)
    model.eval()
    res["load_policy_s"] = time.perf_counter() - t0
    rows = load_examples(args.data, split="test", limit=args.prompts)
    prompts = [build_prompt_ids(tok, ex.prompt, DEFAULT_SYSTEM_PROMPT) for ex in rows]
    stops = stop_token_ids(tok, model)

    # 1. load: export + vLLM start + adapter from memory
    settings = VLLMSettings(gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=2048,
                            llm_kwargs={"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]}})
    engine = VLLMEngine(stops, settings, tokenizer=tok, seed=0)
    t0 = time.perf_counter()
    engine.sync(model)
    res["first_sync_s"], res["first_sync_parts"] = time.perf_counter() - t0, engine.last_sync
    res["export_bytes"] = sum(f.stat().st_size for f in engine.export_dir.glob("*.safetensors"))
    res["vllm_linear_kernel"] = linear_kernel(engine)
    print("loaded:", res["vllm_linear_kernel"], f"{res['first_sync_s']:.1f} s", flush=True)
    save()

    # 2. greedy tokens: vLLM vs the trainer's own decode
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=args.greedy_tokens)
    v = engine.generate(prompts, 1, greedy, seed=0).completion_ids
    hf = HFEngine(stops, tok.pad_token_id if tok.pad_token_id is not None else stops[0], max_batch_size=len(prompts))
    hf.sync(model)
    t = hf.generate(prompts, 1, greedy, seed=0).completion_ids
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) for x, y in zip(v, t)]
    full = [x == y for x, y in zip(v, t)]
    # where the two greedy decodes part, how close was the trainer's own choice? (a near tie of the
    # top-2 log-probs flips under ~1e-2 numerical differences; a real mismatch shows a large gap)
    gaps = []
    for p, x, y, i in zip(prompts, v, t, prefix):
        if i < min(len(x), len(y)):
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([p + y[:i]], device="cuda")).logits[0, -1].float(), -1)
            gaps.append((logp[y[i]] - logp[x[i]]).item())
    res["greedy"] = {"tokens": args.greedy_tokens, "common_prefix": prefix,
                     "frac_prompts_identical": sum(full) / len(full),
                     "trainer_logprob_gap_at_divergence": gaps}
    print("greedy: identical on", f"{sum(full)}/{len(full)} prompts; common prefixes {prefix}", flush=True)
    save()

    # 3. sampled completions: vLLM's sampler log-probs vs the trainer's teacher-forced ones
    sampling = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.sample_tokens)
    gen = engine.generate(prompts, args.samples, sampling, seed=1)
    rep_prompts = [p for p in prompts for _ in range(args.samples)]
    comps = gen.completion_ids
    before = trainer_logprobs(model, rep_prompts, comps)
    res["sampled_logprobs"] = abs_diff(before, [torch.tensor(x) for x in gen.sampler_logprobs])
    res["scored_vs_sampler"] = abs_diff(vllm_scores(engine, rep_prompts, comps),
                                        [torch.tensor(x) for x in gen.sampler_logprobs])
    print("sampled |Δ logprob|:", res["sampled_logprobs"], flush=True)
    # the same at the temperature / nucleus of a typical recipe: vLLM's processed log-probs against
    # the trainer's of the same filtered distribution (a token the trainer's own top-p set leaves
    # out -- a near tie at the nucleus edge -- is counted, not averaged as an infinity)
    tp = SamplingSettings(temperature=args.temperature, top_p=args.top_p, top_k=0, max_new_tokens=args.sample_tokens)
    gen_tp = engine.generate(prompts, args.samples, tp, seed=2)
    ref_tp = trainer_logprobs(model, rep_prompts, gen_tp.completion_ids, sampling=tp)
    vllm_tp = [torch.tensor(x) for x in gen_tp.sampler_logprobs]
    inside = [torch.isfinite(r.cpu()) for r in ref_tp]
    res["sampled_logprobs_tp"] = {
        "temperature": tp.temperature, "top_p": tp.top_p,
        "outside_trainer_nucleus": sum(int((~m).sum()) for m in inside),
        **abs_diff([r.cpu()[m] for r, m in zip(ref_tp, inside)], [v[m] for v, m in zip(vllm_tp, inside)])}
    print(f"sampled T={tp.temperature} top_p={tp.top_p} |Δ logprob|:", res["sampled_logprobs_tp"], flush=True)
    save()

    # 4. one optimizer step on the adapter: is the new adapter live after sync?
    lora = [p for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.Adam(lora, lr=args.lr)
    model.train()
    n_tokens = sum(len(c) for c in comps)
    for p, c in zip(rep_prompts, comps):  # one sequence at a time: the graph of 64 at once is tens of GB
        (-trainer_logprobs(model, [p], [c], grad=True)[0].sum() / n_tokens).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    after = trainer_logprobs(model, rep_prompts, comps)
    stale = vllm_scores(engine, rep_prompts, comps)
    t0 = time.perf_counter()
    engine.sync(model)
    res["step_sync_s"], res["step_sync_parts"] = time.perf_counter() - t0, engine.last_sync
    live = vllm_scores(engine, rep_prompts, comps)
    res["adapter_update"] = {"trainer_move": abs_diff(after, before), "vllm_stale_vs_trainer": abs_diff(stale, after),
                             "vllm_after_sync_vs_trainer": abs_diff(live, after)}
    print("adapter update:", {k: round(d["mean"], 4) for k, d in res["adapter_update"].items()}, flush=True)
    save()

    # 5. AQN noise: vLLM synced with the noisy scales vs the trainer's noisy and clean forwards
    norms = attach_noisy_norms(model)
    norms.set_noise(args.sigma, seed=0, step=3)
    engine.sync(model, norms.effective_scales())
    noisy_vllm = vllm_scores(engine, rep_prompts, comps)
    noisy_trainer = trainer_logprobs(model, rep_prompts, comps)
    res["aqn"] = {"sigma": args.sigma, "norm_cast_error": engine.norm_cast_error,
                  "vllm_vs_trainer_noisy": abs_diff(noisy_vllm, noisy_trainer),
                  "vllm_vs_trainer_clean": abs_diff(noisy_vllm, after),
                  "trainer_noisy_vs_clean": abs_diff(noisy_trainer, after)}
    # the same draw with scale_precision="bf16" (the vllm recipe's setting): the trainer's noisy scales
    # are stochastically rounded to bf16, so vLLM's bf16 norms hold them exactly (cast error 0)
    norms.set_noise(args.sigma, seed=0, step=3, scale_precision="bf16")
    engine.sync(model, norms.effective_scales())
    noisy_vllm = vllm_scores(engine, rep_prompts, comps)
    noisy_trainer = trainer_logprobs(model, rep_prompts, comps)
    res["aqn"]["bf16_scales"] = {"norm_cast_error": engine.norm_cast_error,
                                 "vllm_vs_trainer_noisy": abs_diff(noisy_vllm, noisy_trainer),
                                 "vllm_vs_trainer_clean": abs_diff(noisy_vllm, after)}
    norms.set_noise(0.0, seed=0, step=3)
    print("aqn:", {k: (round(d["mean"], 4) if isinstance(d, dict) and "mean" in d else d)
                   for k, d in res["aqn"].items()}, flush=True)
    save()

    # 6. sleep releases the KV cache and the weights
    torch.cuda.synchronize()
    engine.wake()
    free_awake = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    engine.sleep()
    sleep_s = time.perf_counter() - t0
    free_asleep = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    engine.wake()
    res["sleep"] = {"freed_gib": (free_asleep - free_awake) / 2**30, "sleep_s": sleep_s,
                    "wake_s": time.perf_counter() - t0}
    engine.sleep()
    print("sleep:", res["sleep"], flush=True)

    # the tolerances this script asserts (exit status 1 when one fails)
    aqn, upd = res["aqn"], res["adapter_update"]
    res["checks"] = {
        "greedy: >= 1/2 of prompts identical over all tokens": res["greedy"]["frac_prompts_identical"] >= 0.5,
        "greedy: every divergence is a near tie (trainer top-2 gap < 0.5 nats)":
            all(abs(g) < 0.5 for g in res["greedy"]["trainer_logprob_gap_at_divergence"]),
        "sampled: mean |dlogprob| <= 0.05, p99 <= 0.5":
            res["sampled_logprobs"]["mean"] <= 0.05 and res["sampled_logprobs"]["p99"] <= 0.5,
        "sampled at T / top-p: mean |dlogprob| <= 0.05, p99 <= 0.5, <= 1% of tokens outside the trainer's nucleus":
            res["sampled_logprobs_tp"]["mean"] <= 0.05 and res["sampled_logprobs_tp"]["p99"] <= 0.5
            and res["sampled_logprobs_tp"]["outside_trainer_nucleus"] <= 0.01 * res["sampled_logprobs_tp"]["tokens"],
        "adapter: after sync mean <= 0.05 and <= 1/5 of the stale one":
            upd["vllm_after_sync_vs_trainer"]["mean"] <= min(0.05, upd["vllm_stale_vs_trainer"]["mean"] / 5),
        "aqn: vLLM closer to the trainer's noisy forward than to its clean one":
            aqn["vllm_vs_trainer_noisy"]["mean"] < aqn["vllm_vs_trainer_clean"]["mean"],
        "aqn bf16 scales: copied exactly (cast error 0)": aqn["bf16_scales"]["norm_cast_error"] == 0.0,
        "sleep: frees >= 1 GiB": res["sleep"]["freed_gib"] >= 1.0,
    }
    import vllm

    res["meta"] = {"command": "python " + " ".join(sys.argv), "vllm": vllm.__version__, "torch": torch.__version__,
                   "date": time.strftime("%Y-%m-%d")}
    save()
    for name, ok in res["checks"].items():
        print("PASS" if ok else "FAIL", name)
    sys.exit(0 if all(res["checks"].values()) else 1)


if __name__ == "__main__":
    main()
