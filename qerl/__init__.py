"""qerl: QeRL — RL for LLM reasoning on a frozen NVFP4 base with LoRA and adaptive quantization noise.

The core (`qerl.*`) imports without Lightning; `lightning_modules/` and `callbacks/` wire it into
`python train.py fit --config configs/X.yaml`.
"""

import os

# torchao's PyPI wheel is a CUDA build; its optional C++ extensions (sm_100 MXFP8, CUTLASS) fail to
# load on CPU with noisy but harmless messages, and nothing in qerl's NVFP4 path needs them.
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

__version__ = "0.1.0"
