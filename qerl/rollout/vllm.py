"""The colocated vLLM rollout engine: NVFP4 base + unmerged LoRA + noisy RMSNorm scales, in process.

Status: written against the vLLM 0.25.0 sources (research/vllm.md); the call sequence is tested on
CPU against a fake ``vllm`` module, and the real thing on an H200 (``benchmarks/vllm_parity.py``,
``benchmarks/rollout_vllm.py``, the GPU test in ``tests/test_vllm_engine.py``; README "Measured").

Manual (``engine: vllm`` in ``RolloutCallback``, settings under ``vllm:`` = :class:`VLLMSettings`):

* **Lazy.** ``vllm`` is imported only when the first ``sync`` builds the engine (never at import,
  so configs parse and CPU tests run without it). The engine runs in the trainer's process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), on the trainer's GPU, with sleep mode.
* **Base, once.** The first ``sync`` exports the frozen base to ``export_dir`` (a temp dir by
  default): compressed-tensors NVFP4A16 (:func:`qerl.export.export_nvfp4`) when the policy's
  linears are NVFP4, else a dense bf16 checkpoint (:func:`qerl.export.export_bf16`; bf16 and NF4
  arms). vLLM loads it with ``enable_lora``, ``max_loras=1``, ``logprobs_mode="processed_logprobs"``.
* **Every step** (``sync`` then ``generate``): wake the weights → push the LoRA A/B tensors from
  memory under a new adapter id (a small loader installed on vLLM's worker feeds them to
  ``LoRAModel.from_lora_tensors``; vllm.md §3.3.3) → copy the noisy norm scales, and any trainable
  norms, in place into vLLM's parameters by name → reset the prefix cache → wake the KV cache →
  ``generate`` with one ``SamplingParams`` per prompt → ``sleep(level=1)``. A ``generate`` outside
  ``awake()`` wakes and sleeps by itself; the RolloutCallback holds the engine awake over a step's
  DAPO refill rounds and evaluation over its batches, and sleeps once at the end. With
  ``adapter_via_disk`` the adapter goes through ``adapter_model.safetensors`` in tmpfs instead
  (public API only), as it does automatically when the in-memory loader cannot be installed
  (a vLLM whose private worker API moved; ``qerl/rollout/vllm_worker.py``). Either way an adapter
  module vLLM would not apply (e.g. ``lm_head``) is an error, not a silently different policy.
* **Evaluation.** ``sync(model, clean_scales, adapter=False)`` serves the base alone (requests
  carry no ``LoRARequest``); validation during ``fit`` and ``validate``/``test`` reuse this engine
  (one vLLM per process), with the clean norm scales pushed, so no AQN noise leaks into evaluation.
* **Limits.** prompt + ``max_new_tokens`` beyond vLLM's ``max_model_len`` is an error (vLLM would
  refuse the prompt or cut the completion short); vLLM's start leaves the trainer's RNG as it was.
* **Sampler log-probs.** vLLM's ``processed_logprobs``: log softmax(logits / T) of the sampled
  token after top-k/top-p masking, renormalised over the kept tokens, which is what the HF engine
  returns too (``Generation``). Greedy (T=0) gives log softmax(logits); since vLLM refuses ``n>1``
  when greedy, each prompt is then sent ``n`` times.
* **Noise precision.** vLLM keeps norms in the model dtype (bf16). With ``AQNCallback(
  scale_precision="bf16")`` the trainer rounds w + Z stochastically to bf16 (unbiased), so the copy
  is exact and vLLM runs the trainer's noisy model. With the default fp32 scales the copy rounds to
  nearest (spacing 2^-7 near 1: noise of sigma below ~4e-3 is largely erased in rollouts while the
  trainer applies it) and a warning says so; ``norm_cast_error`` holds the largest rounding of the
  last sync, and the truncated-IS ratio absorbs the difference.
* **Seeds.** Request i gets its own seed, derived from (seed, i) or given per prompt (vLLM adds the
  sample index), so a step is reproducible and a prompt's samples do not depend on its batch;
  per-request generators cost a small per-row loop in vLLM's sampler (``seed_requests: false``
  turns them off).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qerl.rollout.base import Generation, RolloutEngine, SamplingSettings, prompt_seeds
from qerl.rollout.vllm_conversions import (  # noqa: F401 (ALLOWED_LORA_RANKS: re-exported)
    ALLOWED_LORA_RANKS, adapter_config, adapter_tensors, allowed_lora_rank, hf_to_vllm_norm_name,
    outputs_to_generation, sampling_params_kwargs)
from qerl.seeding import global_rng_state, set_global_rng_state
from qerl.rollout.vllm_worker import copy_norm_scales, install_tensor_lora_loader, max_model_len

log = logging.getLogger(__name__)

IN_MEMORY_PATH = "qerl-in-memory-adapter"  # LoRARequest needs a non-empty path; our loader never reads it


@dataclass
class VLLMSettings:
    """Settings of the colocated vLLM engine (``RolloutCallback(engine="vllm", vllm=...)``).

    Args:
        gpu_memory_utilization: fraction of the GPU vLLM may take (weights + KV cache); it must be
            free when the engine starts (TRL and QeRL use 0.3).
        max_lora_rank: LoRA slot size; raised to the adapter's rank if smaller, then rounded up to
            a rank vLLM allows (1, 8, 16, 32, 64, ...).
        sleep: sleep mode: release the KV cache and offload the weights to the host between
            rollouts (``sleep(level=1)``), so training gets the memory back.
        export_dir: where the base checkpoint is written once (default: a temporary directory).
        max_model_len: longest prompt + completion (default: the model's context length).
        seed_requests: give every request its own seed (reproducible; a bit slower to sample).
        adapter_via_disk: push the adapter through files in tmpfs instead of from memory.
        llm_kwargs: extra keyword arguments of ``vllm.LLM`` (e.g. ``enforce_eager``,
            ``kv_cache_memory_bytes``, ``max_num_seqs``); they override the ones set here.
    """

    gpu_memory_utilization: float = 0.3
    max_lora_rank: int = 32
    sleep: bool = True
    export_dir: str | None = None
    max_model_len: int | None = None
    seed_requests: bool = True
    adapter_via_disk: bool = False
    llm_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            if int(self.llm_kwargs.get(key) or 1) != 1:  # the model lives in worker processes then
                raise ValueError(f"vllm.llm_kwargs.{key} > 1: the colocated engine runs vLLM in the trainer's process "
                                 "(adapter and norm scales are written into its model in place); use one GPU per "
                                 "rank (DDP: each rank runs its own vLLM)")


# ----------------------------------------------------------------------------- process state vLLM's start touches
@contextlib.contextmanager
def _rng_preserved():
    """Restore Python's, NumPy's and torch's global generators afterwards (vLLM reseeds them)."""
    state = global_rng_state()
    try:
        yield
    finally:
        set_global_rng_state(state)


@contextlib.contextmanager
def _torchrun_env():
    """Under DDP: the variables vLLM's ``external_launcher`` reads (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``), which torchrun sets and Lightning's own launcher does not (it sets
    ``LOCAL_RANK`` and ``MASTER_*`` only). ``LOCAL_RANK`` becomes the CUDA device this rank trains
    on, which is the device vLLM's worker takes. Restored afterwards."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        yield
        return
    want = {"RANK": str(torch.distributed.get_rank()), "WORLD_SIZE": str(torch.distributed.get_world_size())}
    if torch.cuda.is_available():
        want["LOCAL_RANK"] = str(torch.cuda.current_device())
    old = {k: os.environ.get(k) for k in want}
    os.environ.update(want)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------- the engine
class VLLMEngine(RolloutEngine):
    """Rollouts on a colocated, in-process vLLM (see the module docstring).

    Args:
        stop_token_ids: token ids that end a completion (EOS, ``<|im_end|>``...).
        settings: :class:`VLLMSettings`.
        tokenizer: written next to the exported base (vLLM itself gets token ids only).
        seed: seed of vLLM's own generator (requests are seeded per call).
    """

    def __init__(self, stop_token_ids: list[int], settings: VLLMSettings | None = None, tokenizer=None, seed: int = 0):
        self.stop_token_ids = sorted({int(t) for t in stop_token_ids if t is not None})
        self.settings = settings or VLLMSettings()
        self.tokenizer, self.seed = tokenizer, seed
        self.llm = None
        self.export_dir: Path | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._adapters: dict[int, tuple[dict, dict]] = {}  # read by the loader inside vLLM
        self._lora_id, self._lora_request, self._synced = 0, None, False
        self._hold_awake = False
        self._asleep: set[str] = set()
        self._use_disk = self.settings.adapter_via_disk
        self._warned_rounding = False
        self.norm_cast_error = 0.0
        self.last_sync: dict[str, float] = {}

    # -- lifecycle
    def _export(self, model: nn.Module) -> Path:
        from qerl.export import export_bf16, export_nvfp4
        from qerl.nvfp4 import NVFP4WeightTensor

        if self.settings.export_dir is not None:
            out = Path(self.settings.export_dir)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="qerl-vllm-")
            out = Path(self._tmp.name)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            out = out / f"rank{torch.distributed.get_rank()}"
        nvfp4 = any(isinstance(p, NVFP4WeightTensor) for p in model.parameters())
        # the adapter is not written: every sync pushes it from memory
        return (export_nvfp4 if nvfp4 else export_bf16)(model, self.tokenizer, out, dtype="bf16", with_adapter=False)

    def _start(self, model: nn.Module) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process (vllm.md §3.2)
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # processed logprobs need the native sampler
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        import vllm

        s = self.settings
        rank = adapter_config(model)["r"]  # a policy without LoRA fails here, before minutes of export
        self.export_dir = self._export(model)
        kwargs: dict[str, Any] = dict(
            model=str(self.export_dir), dtype="bfloat16", enable_lora=True, max_loras=1,
            max_lora_rank=allowed_lora_rank(max(s.max_lora_rank, rank)), seed=self.seed,
            gpu_memory_utilization=s.gpu_memory_utilization, enable_sleep_mode=s.sleep,
            max_model_len=s.max_model_len, logprobs_mode="processed_logprobs", skip_tokenizer_init=True)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # as TRL and verl do under DDP: one engine per rank (vLLM's "external DP"), no workers of its own
            kwargs["distributed_executor_backend"] = "external_launcher"
        kwargs.update(s.llm_kwargs)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # vLLM sizes its share from the free memory it sees at start
        with _rng_preserved(), _torchrun_env():  # vLLM seeds the process-global generators with its own seed
            self.llm = vllm.LLM(**kwargs)
        if not self._use_disk:
            try:
                self.llm.collective_rpc(install_tensor_lora_loader, args=(self._adapters,))
            except AttributeError as err:  # vLLM's private worker API moved: fall back to files in tmpfs
                log.warning("in-memory LoRA loader unavailable on this vLLM (%s): adapters go through tmpfs", err)
                self._use_disk = True

    def wake(self, tags: list[str] | None = None) -> None:
        todo = [t for t in (tags or ["weights", "kv_cache"]) if t in self._asleep]
        if todo:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # hand the trainer's cached blocks back before vLLM maps its own
            self.llm.wake_up(tags=todo)
            self._asleep -= set(todo)

    def sleep(self) -> None:
        if self.llm is None or not self.settings.sleep or self._asleep == {"weights", "kv_cache"}:
            return
        self.wake()  # half awake (after sync, before generate): vLLM sleeps only from fully awake
        self.llm.sleep(level=1)  # level 1 keeps the base on the host; level 2 would drop it
        self._asleep = {"weights", "kv_cache"}

    @contextlib.contextmanager
    def awake(self):
        """No sleep between the ``generate`` calls inside (evaluation batches): sleeping offloads the
        weights to the host and back every call. Sleeps once at the end."""
        self._hold_awake = True
        try:
            yield
        finally:
            self._hold_awake = False
            self.sleep()

    # -- per step
    def _push_adapter(self, model: nn.Module) -> None:
        from vllm.lora.request import LoRARequest

        tensors, config = adapter_tensors(model), adapter_config(model)
        if not tensors:
            raise ValueError("the vLLM engine needs a peft LoRA policy (no lora_A/lora_B tensors found)")
        previous, self._lora_id = self._lora_id, self._lora_id + 1
        name, path = f"qerl-policy-{self._lora_id}", IN_MEMORY_PATH
        if self._use_disk:
            path = str(self._write_adapter(tensors, config))
        else:
            self._adapters.clear()
            self._adapters[self._lora_id] = (tensors, config)
        engine = self.llm.llm_engine
        if previous:
            engine.remove_lora(previous)
        request = LoRARequest(name, self._lora_id, path)
        if not engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load adapter {name}")
        self._lora_request = request  # generate passes it as is (load_inplace=False)

    def _write_adapter(self, tensors: dict, config: dict) -> Path:
        from safetensors.torch import save_file

        root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        out = root / f"qerl-adapter-{os.getpid()}-{self._lora_id % 2}"  # two slots: never the loaded one
        if not out.is_dir():  # tmpfs is RAM: the slots go when the engine does, or at exit
            out.mkdir(parents=True)
            weakref.finalize(self, shutil.rmtree, str(out), True)
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        (out / "adapter_config.json").write_text(json.dumps(config))
        return out

    def _push_norms(self, model: nn.Module, norm_scales: dict[str, torch.Tensor] | None) -> None:
        scales = {hf_to_vllm_norm_name(n): p.detach() for n, p in model.named_parameters()
                  if p.requires_grad and "lora_" not in n}  # trainable norms: base weights in vLLM
        trained = bool(scales)
        scales.update({hf_to_vllm_norm_name(n): s for n, s in (norm_scales or {}).items()})
        if scales:
            self.norm_cast_error = max(self.llm.apply_model(lambda m: copy_norm_scales(m, scales)))
            if self.norm_cast_error > 0 and not self._warned_rounding:
                causes = (["AQN noise below half a bf16 step is erased unless AQNCallback(scale_precision='bf16') "
                           "rounds it stochastically in the trainer"] if norm_scales else []) + (
                          ["the trained norm scales (fp32 master weights) reach vLLM in whole bf16 steps (~4e-3 "
                           "near 1; the importance weights correct the difference)"] if trained else [])
                log.warning("vLLM keeps norms in bf16: the norm scales were rounded to nearest (largest change %.2g): "
                            "%s", self.norm_cast_error, "; ".join(causes))
                self._warned_rounding = True

    @torch.inference_mode(False)  # validate/test run under inference mode: exporting the base cannot
    def sync(self, model: nn.Module, norm_scales: dict[str, torch.Tensor] | None = None, adapter: bool = True) -> None:
        t0 = time.perf_counter()
        if self.llm is None:
            self._start(model)
        t1 = time.perf_counter()
        self.wake(["weights"])  # write weights only into mapped memory
        if adapter:
            self._push_adapter(model)
        else:  # the base alone: requests go without a LoRARequest (the last adapter stays loaded, unused)
            self._lora_request = None
        self._synced = True
        t2 = time.perf_counter()
        self._push_norms(model, norm_scales)
        if self.llm.reset_prefix_cache() is False:  # cache keys hold the adapter name only, not the norms
            log.warning("vLLM could not reset its prefix cache (requests still running?)")
        self.last_sync = {"start": t1 - t0, "adapter": t2 - t1, "norms": time.perf_counter() - t2}

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingSettings,
                 seed: int | Sequence[int]) -> Generation:
        if self.llm is None or not self._synced:
            raise RuntimeError("VLLMEngine.generate called before sync(model)")
        from vllm import SamplingParams

        limit = max_model_len(self.llm)
        longest = max((len(p) for p in prompt_ids), default=0)
        if limit is not None and longest + sampling.max_new_tokens > limit:
            # vLLM would refuse the prompt mid-step, or cut the completion short of max_new_tokens
            raise ValueError(f"a prompt of {longest} tokens + max_new_tokens={sampling.max_new_tokens} exceeds "
                             f"vLLM's max_model_len={limit}: raise vllm.max_model_len or lower "
                             "data.max_prompt_length / sampling.max_new_tokens")
        start = time.perf_counter()
        self.wake(["weights", "kv_cache"])
        kw = sampling_params_kwargs(sampling, n)
        reps = n // kw["n"]
        prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in prompt_ids for _ in range(reps)]
        seeded = sampling.temperature > 0 and self.settings.seed_requests
        seeds = prompt_seeds(seed, len(prompt_ids))  # (vLLM draws sample j of request i from seeds[i] + j)
        params = [SamplingParams(**kw, seed=seeds[i // reps] if seeded else None, stop_token_ids=list(self.stop_token_ids))
                  for i in range(len(prompts))]
        t0 = time.perf_counter()
        outputs = self.llm.generate(prompts, params, lora_request=self._lora_request, use_tqdm=False)
        gen = outputs_to_generation(outputs)
        t1 = time.perf_counter()
        if not self._hold_awake:
            self.sleep()
        gen.timings = {"wake": t0 - start, "generate": t1 - t0, "sleep": time.perf_counter() - t1}
        return gen
