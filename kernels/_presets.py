"""Pinned kernel configs (``kernels/presets_h200.json``): the Qwen2.5 0.5B / 1.5B / 3B / 7B / 32B linear shapes on the H200.

Winners of the graph-timed tuner (``kernels._launch.tune``), written by
``python benchmarks/kernels.py --tune --write-presets kernels/presets_h200.json``, keyed by
(op, bucket(M), N, K) and applied for bf16 and fp16 activations (a ``cuda`` or ``wgmma`` preset runs the Triton
default for fp16, which the CUDA kernel does not take). With a preset no timing happens on first
use, so the first call may also be made during CUDA-graph capture. ``QERL_KERNELS_PRESETS=0``
ignores them (then the tuner runs).
"""

import dataclasses
import json
import os

import torch

PRESETS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets_h200.json")
_DTYPES = (torch.bfloat16, torch.float16)


def load_presets(path: str = PRESETS_FILE) -> dict:
    """{(op, dtype, bucket, N, K): Config} from a presets file (fields left out take Config's defaults)."""
    from ._launch import Config      # (here: _launch imports this module while it initialises)

    with open(path) as f:
        rows = json.load(f)["configs"]
    out = {}
    for r in rows:
        cfg = Config(**r["config"])
        for dt in _DTYPES:
            out[(r["op"], dt, int(r["bucket"]), int(r["N"]), int(r["K"]))] = cfg
    return out


def presets_rows(table: dict) -> list[dict]:
    """The file's rows for {(op, dtype, bucket, N, K): Config} (one row per key without the dtype;
    fields equal to Config's defaults are left out)."""
    from ._launch import Config

    default = dataclasses.asdict(Config())
    rows = {}
    for (op, _dt, mb, n, k), cfg in table.items():
        d = {f: v for f, v in dataclasses.asdict(cfg).items() if f == "kind" or v != default[f]}
        rows[(op, mb, n, k)] = {"op": op, "bucket": mb, "N": n, "K": k, "config": d}
    return [rows[key] for key in sorted(rows, key=lambda t: (t[2], t[3], t[1], t[0] != "fwd"))]


def write_presets(table: dict, path: str, how: str, device: str) -> None:
    """Write ``table`` as a presets file, one config per line."""
    rows = presets_rows(table)
    with open(path, "w") as f:
        f.write('{\n"device": %s,\n"how": %s,\n"configs": [\n' % (json.dumps(device), json.dumps(how)))
        f.write(",\n".join(json.dumps(r, separators=(", ", ": ")) for r in rows))
        f.write("\n]}\n")


def qwen_presets() -> dict:
    return load_presets(PRESETS_FILE)
