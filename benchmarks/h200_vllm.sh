#!/usr/bin/env bash
# Issue #6's H200 runs (colocated vLLM), stage by stage, on the lent GPU machine (device tool).
#
#   ../shared/tools/gpu-pack vllm; ../shared/tools/gpu-pack deps; ../shared/tools/gpu-pack testbed
#   (+ the LightningCLI wheels the GPU image lacks, in .whl/cli: jsonargparse, docstring-parser, typeshed-client)
#   then one device call per chunk (cp .carry/<name>/cN/* /tmp/carry-<name>/), and
#   bash benchmarks/h200_vllm.sh setup            # unpack + install the bundles, GGUF -> /tmp/testbed_bf16
#   bash benchmarks/h200_vllm.sh parity gputest   # benchmarks/vllm_parity.py + every GPU test file (GPU_TEST_FILES)
#   bash benchmarks/h200_vllm.sh smolparity       # the same on SmolLM2-135M (Llama, tied embeddings; BUNDLES="vllm deps smollm2" setup)
#   bash benchmarks/h200_vllm.sh fit              # a short GRPO fit through train.py with engine: vllm
#   bash benchmarks/h200_vllm.sh dapofit          # DAPO dynamic sampling in vLLM (refill rounds in one awake engine), tiny model
#   bash benchmarks/h200_vllm.sh bench            # benchmarks/rollout_vllm.py (7B shape, nvfp4 vs bf16)
#   bash benchmarks/h200_vllm.sh eval             # benchmarks/eval_base.py: GSM8K pass@1 of the three arms
#   bash benchmarks/h200_vllm.sh evalvllm         # the same through the vLLM engine (one process per arm)
#   bash benchmarks/h200_vllm.sh fitval           # a vLLM fit with validation in vLLM (sanity check + after step 4)
#   bash benchmarks/h200_vllm.sh learn            # nvfp4 vs bf16 LoRA: LEARN_STEPS steps on GSM8K train, then GSM8K test
#   bash benchmarks/h200_vllm.sh gspo             # 8 steps of the GSPO testbed recipe, embedded engine (no vLLM)
# Logs and JSON land in $OUT (the device tool's return folder) or /tmp/out.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1
export PYTHONPATH=/tmp/site-vllm:/tmp/site-deps:/tmp/site-gguf:/tmp/site-cli:$PWD
TESTBED=/tmp/testbed_bf16

unpack() {  # name: /tmp/carry-<name>/part.* -> /tmp/carry-<name>/files (+ its wheels in /tmp/site-<name>)
  local name=$1 site=/tmp/site-$1
  case "$name" in testbed|smollm2) site=/tmp/site-gguf ;; esac  # model bundles: a GGUF + the gguf wheel
  [ -d /tmp/carry-"$name"/files ] || { cat /tmp/carry-"$name"/part.* | tar xf - -C /tmp/carry-"$name" || return 1; }
  [ -d "$site" ] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" /tmp/carry-"$name"/files/*.whl
}

for stage in "$@"; do
  case "$stage" in
    setup)
      for b in ${BUNDLES:-vllm deps testbed}; do unpack $b || echo "unpack $b failed"; done
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-cli .whl/cli/*.whl
      [ -d $TESTBED ] || [ ! -d /tmp/carry-testbed ] || python3 -m qerl.export --model /tmp/carry-testbed/files/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
        --format bf16 --out $TESTBED 2>&1 | tail -3
      python3 -c "import vllm, torchao, jsonargparse; print('vllm', vllm.__version__, 'torchao', torchao.__version__)"
      ;;
    parity)
      timeout 330 python3 benchmarks/vllm_parity.py --model $TESTBED --data data/gsm8k/test.jsonl \
        --out "$OUT"/vllm_parity_h200.json > "$OUT"/parity.log 2>&1; echo "parity exit $?"
      grep -v "^INFO\|^DEBUG" "$OUT"/parity.log | tail -25
      ;;
    smolparity)  # a Llama-architecture model with tied embeddings (SmolLM2-135M-Instruct, gpu-pack smollm2)
      SMOL=/tmp/smollm2_bf16
      [ -d $SMOL ] || python3 -m qerl.export --model /tmp/carry-smollm2/files/SmolLM2-135M-Instruct.Q4_1.gguf \
        --format bf16 --out $SMOL 2>&1 | tail -2
      for q in ${SMOL_ARMS:-nvfp4}; do  # SMOL_ARMS=bf16 in a second call: the gap the model itself has (each arm ~150-330 s)
        timeout 330 python3 benchmarks/vllm_parity.py --model $SMOL --data data/gsm8k/test.jsonl --quantization $q \
          --out "$OUT"/vllm_parity_smollm2_${q}_h200.json > "$OUT"/smolparity_$q.log 2>&1; echo "smolparity $q exit $?"
        grep -v "^INFO\|^DEBUG\|^WARNING" "$OUT"/smolparity_$q.log | tail -14
      done
      ;;
    gputest)  # one process per file: with vLLM and the deliberately failed CUDA-graph capture of
      # test_rollout_hf in one process, all tests pass but the process aborts at exit
      # (captures_underway.empty(), CUDACachingAllocator); each file alone exits cleanly
      for f in ${GPU_TEST_FILES:-$(grep -l "mark.gpu" tests/test_*.py)}; do
        timeout ${GPUTEST_TIMEOUT:-300} python3 -m pytest -q -m gpu $f > "$OUT"/gputest_$(basename $f .py).log 2>&1
        echo "gputest $f exit $?"; tail -1 "$OUT"/gputest_$(basename $f .py).log
      done
      ;;
    eval)  # issue #7's base-model rows: GSM8K test, greedy, three arms (needs the deps bundle for nf4);
      # (EVAL_ARMS=bf16,nvfp4 for some). Each arm's completions (its eval/val_step0.json) come back as
      # $OUT/eval_completions_<arm>.json, to re-score on a CPU later
      arms=${EVAL_ARMS:-bf16,nvfp4,nf4}; arms=${arms// /,}  # (commas or spaces)
      rm -rf /tmp/eval_logs
      timeout 560 python3 benchmarks/eval_base.py --model $TESTBED --data data/gsm8k/test.jsonl --arms $arms \
        --log-dir /tmp/eval_logs --out "$OUT"/eval_base_h200.json > "$OUT"/eval.log 2>&1
      echo "eval exit $?"; grep -v "^INFO\|^DEBUG" "$OUT"/eval.log | tail -12
      for arm in ${arms//,/ }; do cp /tmp/eval_logs/$arm/version_0/eval/val_step0.json "$OUT"/eval_completions_$arm.json; done
      ;;
    evalvllm)  # issue #7 "works with both engines": the same rows, evaluated in vLLM
      evarms=${EVAL_ARMS:-nvfp4 bf16 nf4}
      for arm in ${evarms//,/ }; do  # (spaces or commas; one process per arm)
        timeout 240 python3 benchmarks/eval_base.py --model $TESTBED --data data/gsm8k/test.jsonl --arms $arm \
          --engine vllm --append --out "$OUT"/eval_base_vllm_h200.json > "$OUT"/evalvllm_$arm.log 2>&1
        echo "evalvllm $arm exit $?"; grep -v "^INFO\|^DEBUG\|^(EngineCore" "$OUT"/evalvllm_$arm.log | tail -4
      done
      ;;
    fitval)  # validation in the same vLLM (sanity check, then after 2 rollout batches = 4 optimizer steps)
      rm -rf logs/fitval_vllm
      timeout 400 python3 train.py fit --config configs/testbed_qwen2.5-coder-0.5b_grpo_nvfp4_vllm.yaml \
        --model.model $TESTBED --trainer.max_steps 4 --trainer.val_check_interval 2 --trainer.num_sanity_val_steps 1 \
        --trainer.limit_val_batches 1 --model.eval.max_batch_size 64 --data.prompts_per_step 16 \
        --trainer.logger.init_args.save_dir logs/fitval_vllm > "$OUT"/fitval.log 2>&1
      echo "fitval exit $?"; grep -v "^INFO\|^DEBUG\|^(EngineCore" "$OUT"/fitval.log | tail -15
      python3 benchmarks/tb_scalars.py logs/fitval_vllm --out "$OUT"/fitval_vllm_h200.json | tail -8
      for f in logs/fitval_vllm/*/version_*/eval/*.md; do echo "$f"; cat "$f"; done
      ;;
    dapofit)  # DAPO dynamic sampling through vLLM on the quickstart's tiny model (bf16: its 64-wide layers are
      # below Marlin's minimum), accuracy reward only: a random model scores 0 everywhere, so every step
      # drops its groups and refills, each refill round in the same awake vLLM (one sleep per step)
      python3 -c "import yaml; c = yaml.safe_load(open('configs/quickstart.yaml'))
c['trainer'].update(accelerator='gpu', max_steps=5, limit_val_batches=0)
c['model'].update(quantization='bf16', dtype='bf16')
for cb in c['trainer']['callbacks']:
    if cb['class_path'].endswith('RolloutCallback'):
        a = cb['init_args']; a.pop('overlong_buffer'); a.pop('overlong_penalty')
        a.update(engine='vllm', dynamic_sampling=True, max_refill_rounds=2, reward={'class_path': 'qerl.rewards.MathAccuracy'},
                 vllm={'gpu_memory_utilization': 0.2, 'max_model_len': 512})
yaml.safe_dump(c, open('/tmp/dapofit.yaml', 'w'))"
      rm -rf logs/dapofit
      timeout ${DAPOFIT_TIMEOUT:-240} python3 train.py fit --config /tmp/dapofit.yaml \
        --trainer.logger.init_args.save_dir logs/dapofit > "$OUT"/dapofit.log 2>&1
      echo "dapofit exit $?"; grep -v "^INFO\|^DEBUG\|^(EngineCore" "$OUT"/dapofit.log | tail -8
      python3 benchmarks/tb_scalars.py logs/dapofit --out "$OUT"/fit_dapo_vllm_tiny_h200.json --tags \
        train/reward,train/reward_sampled,train/groups_dropped,time/generate,time/generate/sleep,time/generate/wake,time/sync,time/train | tail -8
      ;;
    fit)
      rm -rf logs/fit_vllm
      timeout 420 python3 train.py fit --config configs/testbed_qwen2.5-coder-0.5b_grpo_nvfp4_vllm.yaml \
        --model.model $TESTBED --trainer.max_steps 8 --trainer.limit_val_batches 0 --data.prompts_per_step 16 \
        --trainer.logger.init_args.save_dir logs/fit_vllm > "$OUT"/fit.log 2>&1
      echo "fit exit $?"; grep -v "^INFO\|^DEBUG" "$OUT"/fit.log | tail -15
      python3 benchmarks/tb_scalars.py logs/fit_vllm --out "$OUT"/fit_vllm_h200.json | tail -30
      ;;
    learn)  # QeRL (nvfp4) vs 16-bit LoRA (bf16) learning on GSM8K train, one GPU per arm when there are two
      # (else the arms run one after the other), LEARN_STEPS optimizer steps at LEARN_LR, then validation
      # on all of GSM8K test in the same vLLM; each arm's scalars -> $OUT/learn_<arm>.json
      steps=${LEARN_STEPS:-80}; ngpu=$(nvidia-smi -L | wc -l); gpu=0
      for arm in ${LEARN_ARMS:-nvfp4 bf16}; do
        rm -rf logs/learn_$arm; cfg=configs/testbed_qwen2.5-coder-0.5b_grpo_nvfp4_vllm.yaml
        if [ "${arm%-noaqn}" != "$arm" ]; then  # <quantization>-noaqn: the same recipe with sigma = 0
          python3 -c "import yaml; c = yaml.safe_load(open('$cfg'))
for cb in c['trainer']['callbacks']:
    if cb['class_path'].endswith('AQNCallback'): cb['init_args']['controller'] = {'class_path': 'qerl.aqn.NoNoise'}
yaml.safe_dump(c, open('/tmp/learn_$arm.yaml', 'w'))"; cfg=/tmp/learn_$arm.yaml
        fi
        CUDA_VISIBLE_DEVICES=$gpu timeout ${LEARN_TIMEOUT:-585} python3 train.py fit \
          --config $cfg --model.model $TESTBED --model.quantization ${arm%-noaqn} --model.optimizer.lr ${LEARN_LR:-1.0e-5} --trainer.max_steps $steps \
          --trainer.val_check_interval $((steps / 2)) --data.val_sources '{gsm8k: data/gsm8k/test.jsonl}' \
          --trainer.logger.init_args.save_dir logs/learn_$arm > "$OUT"/learn_$arm.log 2>&1 &
        if [ "$ngpu" -ge 2 ]; then gpu=$((gpu + 1)); else wait; fi
      done
      wait
      for arm in ${LEARN_ARMS:-nvfp4 bf16}; do
        echo "== $arm"; grep -v "^INFO\|^DEBUG\|^(EngineCore" "$OUT"/learn_$arm.log | tail -4
        python3 benchmarks/tb_scalars.py logs/learn_$arm --out "$OUT"/learn_$arm.json \
          --tags train/reward,train/entropy,train/frac_reward_zero_std,aqn/sigma,train/completion_length/mean,val/gsm8k/pass@1 | tail -45
        for f in logs/learn_$arm/*/version_*/eval/*.md; do cp "$f" "$OUT"/learn_${arm}_$(basename "$f"); done
      done
      ;;
    bench)
      timeout 560 python3 benchmarks/rollout_vllm.py --out "$OUT"/rollout_vllm_h200.json > "$OUT"/bench.log 2>&1
      echo "bench exit $?"; grep -v "^INFO\|^DEBUG\|^(EngineCore" "$OUT"/bench.log | tail -30
      ;;
    gspo)  # the GSPO testbed recipe with the embedded engine (needs only deps + testbed): 8 steps
      unpack deps; unpack testbed
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-cli .whl/cli/*.whl
      rm -rf logs/gspo
      timeout ${GSPO_TIMEOUT:-460} python3 train.py fit --config configs/testbed_qwen2.5-coder-0.5b_gspo_nvfp4.yaml \
        --trainer.max_steps ${GSPO_STEPS:-8} --trainer.limit_val_batches 0 --trainer.logger.init_args.save_dir logs/gspo \
        > "$OUT"/gspo.log 2>&1
      echo "gspo exit $?"; grep -v "^INFO\|^DEBUG" "$OUT"/gspo.log | tail -12
      python3 benchmarks/tb_scalars.py logs/gspo --out "$OUT"/fit_gspo_h200.json --tags \
        train/reward,train/entropy,train/is_ratio/mean,train/clip_ratio/low,train/clip_ratio/high,train/loss,train/grad_norm,aqn/sigma,train/completion_length/mean,time/generate,time/train | tail -12
      ;;
    *) echo "unknown stage $stage" ;;
  esac
done
