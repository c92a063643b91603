"""qerl: QeRL — RL for LLM reasoning on a frozen NVFP4 base with LoRA and adaptive quantization noise.

The core (`qerl.*`) imports without Lightning; `lightning_modules/` and `callbacks/` wire it into
`python train.py fit --config configs/X.yaml`.
"""

import logging
import os


def drop_log_lines(logger_name: str, fragment: str) -> None:
    """Drop the records of one library logger whose message contains ``fragment``: a third-party line
    that prints on every run and says nothing about it (the logger's other records pass)."""
    logging.getLogger(logger_name).addFilter(lambda record: fragment not in record.getMessage())


# torchao's PyPI wheel is a CUDA build; its optional C++ extensions (sm_100 MXFP8, CUTLASS) fail to
# load on CPU with noisy but harmless messages, and nothing in qerl's NVFP4 path needs them.
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
drop_log_lines("torchao", "due to TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1")  # (torchao then says it skipped them)

# bitsandbytes (imported by peft) looks for Hugging Face's `kernels` package at import on AVX512-BF16
# CPUs, meets this repository's kernels/ on the path and warns; the CPU gemv it wanted is one qerl
# turns off anyway (qerl.quantize.quantize_decoder_linears_nf4 keeps bitsandbytes' autograd path).
drop_log_lines("bitsandbytes.backends.cpu.ops", "kernels-community")

# torch >= 2.13 warns, once per enum, that torchao's register_constant() calls on its Enum settings
# (KernelPreference, ScaleCalculationMode) are deprecated: torchao's business, two lines on every run.
drop_log_lines("torch.utils._pytree", "is an Enum subclass and is now natively supported")

__version__ = "0.1.0"
