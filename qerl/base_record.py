"""The base an adapter was trained on, as qerl records it: ``qerl_base.json`` beside an adapter (and a
training checkpoint's ``qerl_base``), ``qerl_dequantized_base.json`` in a dense export of that base,
what a training checkpoint says about its base, and whether two model names are the same model.

``qerl.adapter`` writes and reads these records with the adapter (its names re-exported there).
"""

from __future__ import annotations

import json
from pathlib import Path

from qerl.model import TINY_MODEL_NAMES

# The base an adapter was trained on, as qerl built it (a tiny model's weights are its seed's, its
# NVFP4 codes its dtype's; ``python -m qerl.export`` rebuilds that base): these keys, in qerl_base.json
# beside an adapter and as a training checkpoint's ``qerl_base``.
BASE_FILE = "qerl_base.json"
# In a model folder that ``--format bf16 --from-trained-base`` wrote: the base record those 16-bit
# weights are the dequantization of, so an adapter trained on that base is at home there.
DEQUANTIZED_BASE_FILE = "qerl_dequantized_base.json"
BASE_KEYS = ("model", "dtype", "seed", "quantization")


def _record_text(base: dict) -> str:
    """A base record as its JSON file holds it (the :data:`BASE_KEYS`, in order)."""
    return json.dumps({k: base.get(k) for k in BASE_KEYS}, indent=1) + "\n"


def _write_base(out: Path, base: dict | None) -> None:
    """``qerl_base.json`` beside an adapter, or none (an earlier run's file removed)."""
    (out / BASE_FILE).unlink(missing_ok=True)
    if base:
        (out / BASE_FILE).write_text(_record_text(base))


def read_base(adapter_dir: str | Path) -> dict | None:
    """The base an adapter directory records (``qerl_base.json``), or None (no file: not written by qerl)."""
    if not Path(adapter_dir).is_dir():  # (the adapter's own loader says what is wrong with the path)
        return None
    try:
        base = json.loads((Path(adapter_dir) / BASE_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise ValueError(f"{adapter_dir}/{BASE_FILE}: unreadable ({err})") from err
    return base if isinstance(base, dict) else None


def read_peft_base(adapter_dir: str | Path) -> str | None:
    """The base model peft's ``adapter_config.json`` names (``base_model_name_or_path``), or None: what an adapter
    qerl did not write (no ``qerl_base.json``) says of its base. An unreadable file is a ValueError."""
    path = Path(adapter_dir) / "adapter_config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: unreadable ({err})") from err
    name = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    return str(name) if name else None


def write_dequantized_base(model_dir: Path, base: dict) -> None:
    """Mark ``model_dir`` (a dense export) as the dequantized ``base`` (:data:`DEQUANTIZED_BASE_FILE`)."""
    (model_dir / DEQUANTIZED_BASE_FILE).write_text(_record_text(base))


def read_dequantized_base(model: str) -> dict | None:
    """The base record a ``--from-trained-base`` export in the folder ``model`` is the dequantization
    of, or None (not such a folder)."""
    try:
        record = json.loads((Path(model).expanduser() / DEQUANTIZED_BASE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("model") else None


def is_dequantized_base(model: str, base: dict) -> bool:
    """Whether the model folder ``model`` holds ``base`` itself, dequantized (a ``--from-trained-base``
    export of it): an adapter recording ``base`` then runs there on the weights it trained on, although
    the name and the quantization differ."""
    record = read_dequantized_base(model)
    if record is None or not base.get("model"):
        return False
    # (NVFP4 codes depend on the dtype the base was built in; a seed builds only a tiny model's weights)
    keys = ("quantization", "dtype", "seed") if base["model"] in TINY_MODEL_NAMES else ("quantization", "dtype")
    return same_model(str(record["model"]), str(base["model"])) and all(
        base.get(k) is None or str(record.get(k)) == str(base[k]) for k in keys)


def same_model(a: str, b: str) -> bool:
    """Whether two model names are the same string or the same path. A .gguf file also matches its
    folder: peft records that folder as the base of a model loaded from the file."""
    if a == b:
        return True
    pa, pb = (Path(x).expanduser().resolve() for x in (a, b))
    if not (pa.exists() and pb.exists()):
        return False
    folder = [p.parent if p.suffix.lower() == ".gguf" and p.is_file() else p for p in (pa, pb)]
    return pa == pb or ((pa.is_dir() or pb.is_dir()) and folder[0] == folder[1])


def checkpoint_base(ckpt: dict) -> dict:
    """The base a training checkpoint's run built ({"model", "dtype", "seed", "quantization"}): its
    ``qerl_base`` record, or for older files what its hyper-parameters and data module say."""
    hp = ckpt.get("hyper_parameters") or {}
    recorded = ckpt.get("qerl_base")
    if isinstance(recorded, dict):
        return {k: recorded.get(k, hp.get(k)) for k in BASE_KEYS}
    return {"model": hp.get("model"), "dtype": hp.get("dtype"), "seed": trained_seed(ckpt),
            "quantization": hp.get("quantization")}


def trained_seed(ckpt: dict) -> int | None:
    """The seed QeRLModule built its tiny model with: its ``seed``, or when that is null the run's
    ``seed_everything``, which the checkpoint holds only as the data module's resolved seed (when
    ``data.seed`` was null too); None when neither is recorded."""
    seed = (ckpt["hyper_parameters"] or {}).get("seed")
    if seed is not None:
        return int(seed)
    data_hp = ckpt.get("datamodule_hyper_parameters")
    data = ckpt.get("PromptDataModule")  # Lightning stores a data module's state under its class name
    key = "data_seed" if isinstance(data_hp, dict) and "data_seed" in data_hp else "seed"  # (its name since 2026-12-02)
    follows_run = isinstance(data_hp, dict) and key in data_hp and data_hp[key] is None
    return int(data["seed"]) if follows_run and isinstance(data, dict) and "seed" in data else None
