import os

import pytest
import torch

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No hub probe in tests (they mock every hub call; tests/test_hub_offline.py tests the probe itself)
os.environ.setdefault("HF_HUB_OFFLINE", "0")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly on CPU machines (CI)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
