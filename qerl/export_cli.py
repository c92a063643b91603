"""The command line of :mod:`qerl.export` (``python -m qerl.export``, whose ``__main__`` calls :func:`main`).

- the arguments, and the checks made before anything loads (``--out`` never clobbers the model, a
  folder other than an earlier export, or a file; ``--adapter`` is readable);
- an export written beside ``--out`` and moved in only once it succeeded (``--overwrite`` replaces
  only files an export writes);
- the base an adapter trained on, as its training checkpoint or ``qerl_base.json`` records it (model,
  dtype, seed, quantization), checked against ``--model`` and rebuilt for the export;
- ``--format adapter``: the adapter of a training checkpoint alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

import qerl.export
from qerl.adapter import (
    BASE_FILE, TRAINABLE_NORMS_FILE, _load_checkpoint, _write_base, adapter_from_checkpoint, check_adapter_dir,
    DEQUANTIZED_BASE_FILE, checkpoint_base, is_dequantized_base, load_adapter, read_base, read_dequantized_base,
    read_peft_base, same_model, write_dequantized_base,
)
from qerl.export import ADAPTER_SUBDIR, export_bf16, export_nvfp4, warn_if_auto_tokenizer_differs
from qerl.model import load_policy
from qerl.norms import BASE_NORMS_DIR, BASE_NORMS_FILE, base_norm_scales
from qerl.tiny import TINY_MODEL_NAMES

log = logging.getLogger(__name__)


_CLI_EPILOG = """\
writes into --out: config.json (+ quantization_config for nvfp4), model.safetensors (or shards +
index), generation_config.json, the tokenizer, and with --adapter: adapter/ (peft adapter_model.
safetensors + adapter_config.json, plus trainable_norms.safetensors when norms were trained).
--adapter may also be a training checkpoint (.ckpt, e.g. checkpoints/<run>/last.ckpt); --format adapter
writes only its adapter into --out (no --model needed, nothing loaded but the checkpoint).

examples:
  python -m qerl.export --model Qwen/Qwen2.5-7B-Instruct --format nvfp4 --out exports/q7b-nvfp4 --device cuda
  python -m qerl.export --model Qwen/Qwen2.5-7B-Instruct --adapter logs/run/version_0/adapter --out exports/rl
  vllm serve exports/rl --enable-lora --max-lora-rank 32 --lora-modules policy=exports/rl/adapter
  python -m qerl.export --format adapter --adapter checkpoints/run/last.ckpt --out exports/rl-step600
"""


def _check_out_is_not_the_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    out = Path(args.out).expanduser().resolve()
    model_path = Path(args.model).expanduser() if args.model else None
    if model_path is not None and model_path.exists() and model_path.resolve() in (out, *out.parents):
        parser.error(f"--out {args.out} would overwrite the model being exported ({args.model})")


def _model_from_the_adapter(parser: argparse.ArgumentParser, args: argparse.Namespace, ckpt: dict | None) -> str:
    """Without --model: the base the --adapter records (a training checkpoint's, ``qerl_base.json``, or
    for an adapter qerl did not write peft's ``base_model_name_or_path``)."""
    try:
        base = checkpoint_base(ckpt) if ckpt is not None else read_base(args.adapter)
        if base is None:
            base = {"model": read_peft_base(args.adapter)}
    except (OSError, ValueError) as err:
        parser.error(f"cannot read --adapter {args.adapter}: {err}")
    if not base or not base.get("model"):
        parser.error(f"--model is required: --adapter {args.adapter} does not record the base it trained on")
    log.info("--model not given: exporting onto %s, the base --adapter %s records", base["model"], args.adapter)
    return str(base["model"])


def _check_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before minutes of loading, an output that would clobber the input or an earlier export."""
    out = Path(args.out).expanduser().resolve()
    is_ckpt = str(args.adapter or "").endswith(".ckpt")
    if args.format == "adapter" and not is_ckpt:
        parser.error("--format adapter converts a training checkpoint: pass --adapter PATH.ckpt")
    if args.format == "adapter":  # nothing is loaded or cast: a base flag there did nothing, silently
        flags = (("--model", args.model), ("--dtype", args.dtype), ("--device", args.device), ("--seed", args.seed),
                 ("--from-nvfp4", args.from_nvfp4), ("--from-trained-base", args.from_trained_base))
        given = [flag for flag, value in flags if value is not None and value is not False]
        if given:
            parser.error(f"--format adapter copies the checkpoint's adapter as it is: "
                         f"{', '.join(given)} would do nothing")
    if args.from_nvfp4 and args.format != "bf16":
        parser.error("--from-nvfp4 goes with --format bf16 (an nvfp4 export writes the NVFP4 codes themselves)")
    args.dtype, args.device = args.dtype or "bf16", args.device or "cpu"  # the defaults, now that they were not given
    if args.format != "adapter" and not args.model and not args.adapter:
        parser.error("--model is required (unless --format adapter, or an --adapter that records its base)")
    if is_ckpt and not Path(args.adapter).is_file():
        parser.error(f"--adapter {args.adapter}: no such checkpoint file")
    _check_out_is_not_the_model(parser, args)
    existing = next(p for p in (out, *out.parents) if p.exists())
    if existing != out and not existing.is_dir():
        parser.error(f"--out {args.out}: {existing} is a file, not a folder")
    writes_in = out.parent if existing == out else existing  # (the export is written beside out, then moved)
    if not os.access(writes_in, os.W_OK):
        parser.error(f"--out {args.out}: {writes_in} is not writable")
    if out.is_file():  # (--overwrite replaces an earlier export folder, never a file)
        parser.error(f"--out {args.out} is a file: give a folder (new, empty, or an earlier export with --overwrite)")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        parser.error(f"--out {args.out} exists and is not empty (pass --overwrite to replace an earlier export)")
    foreign = _foreign_entries(out) if out.is_dir() else []
    if foreign:  # (a run's log folder, say: its adapter/ would go with the export's)
        parser.error(f"--out {args.out} holds files no export writes ({', '.join(foreign[:3])}"
                     f"{', ...' if len(foreign) > 3 else ''}): --overwrite replaces only an earlier export")
    if out.is_dir() and any(out.iterdir()) and not (out / EXPORT_RECORD).is_file():
        # a model folder holds only names an export writes too (config.json, model.safetensors, ...)
        parser.error(f"--out {args.out} has no {EXPORT_RECORD}: not a folder qerl exported (a downloaded model?), "
                     "and --overwrite replaces only those (an export older than that file: delete it yourself)")
    if args.adapter and not is_ckpt:
        try:  # (its config, and the LoRA tensors beside it: without them peft would look on the hub)
            check_adapter_dir(args.adapter)
        except ValueError as err:
            parser.error(f"--{err}")  # "--adapter PATH: ..."
    _check_device(parser, args.device)
    if args.from_trained_base and (args.format != "bf16" or not args.adapter):
        parser.error("--from-trained-base goes with --format bf16 and an --adapter")
    if args.from_trained_base and args.from_nvfp4:
        parser.error("--from-nvfp4 or --from-trained-base: one base, not both")


def _check_device(parser: argparse.ArgumentParser, device: str) -> None:
    """--device is cpu or cuda[:N] of this machine: anything else (``tpu``, a typo) failed only in the
    model loader, and ``meta`` (a valid torch device) would load shapes without weights."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        parser.error(f"--device {device}: not a device (cpu, cuda or cuda:N)")
    if parsed.type not in ("cpu", "cuda"):
        parser.error(f"--device {device}: the export runs on cpu or cuda[:N], not {parsed.type}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}, but this machine has no CUDA device (torch {torch.__version__})")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        parser.error(f"--device {device}, but this machine has {torch.cuda.device_count()} CUDA device(s)")


# Every export's record of what wrote it (format, model, adapter): --overwrite replaces only a folder with one.
EXPORT_RECORD = "qerl_export.json"
# What an export writes, all of which --overwrite replaces: the checkpoint, its config and tokenizer,
# the adapter (in adapter/, or at the top with --format adapter) and what qerl writes beside it.
_EXPORT_FILE = re.compile(
    r"model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|(generation_)?config\.json"
    r"|tokenizer(_config)?\.json|tokenizer\.model|special_tokens_map\.json|vocab\.json|merges\.txt"
    r"|added_tokens\.json|chat_template\.jinja|adapter_config\.json|adapter_model\.safetensors"
    rf"|{re.escape(TRAINABLE_NORMS_FILE)}|{re.escape(BASE_FILE)}|{re.escape(DEQUANTIZED_BASE_FILE)}"
    rf"|{re.escape(EXPORT_RECORD)}")
# ... and its folders with what they hold: the adapter (peft adds a README.md there), and the named
# chat templates transformers 5 writes beside a tokenizer that has several
_EXPORT_DIRS = {
    ADAPTER_SUBDIR: re.compile(rf"adapter_config\.json|adapter_model\.safetensors|README\.md"
                               rf"|{re.escape(TRAINABLE_NORMS_FILE)}|{re.escape(BASE_FILE)}"),
    "additional_chat_templates": re.compile(r".+\.jinja"),
    BASE_NORMS_DIR: re.compile(re.escape(Path(BASE_NORMS_FILE).name)),  # a run's untrained norm scales
}


def _foreign_entries(out: Path) -> list[str]:
    """What in ``out`` no export writes, as paths relative to it: anything outside the patterns above,
    inside the export's folders too (a run's checkpoints or notes under ``adapter/`` would go with
    it), and every symbolic link (clearing would fail on it half-way, or delete what it points to)."""
    foreign = []
    for path in sorted(out.iterdir()):
        if not path.is_symlink() and path.is_dir() and path.name in _EXPORT_DIRS:
            foreign += [f"{path.name}/{p.name}" for p in sorted(path.iterdir())
                        if p.is_symlink() or not p.is_file() or not _EXPORT_DIRS[path.name].fullmatch(p.name)]
        elif path.is_symlink() or not path.is_file() or not _EXPORT_FILE.fullmatch(path.name):
            foreign.append(path.name)
    return foreign


def _written_by_export(path: Path) -> bool:
    """A top-level entry of an earlier export (``_foreign_entries`` found nothing else, inside its folders either)."""
    if path.is_symlink():
        return False
    return (path.is_dir() and path.name in _EXPORT_DIRS) or (path.is_file() and bool(_EXPORT_FILE.fullmatch(path.name)))


def _clear_earlier_export(out: Path) -> None:
    """Remove what an earlier export left in ``out`` (``_check_paths`` refused anything else), so an
    export of another format leaves no stale adapter or shard that a loader would pick up."""
    for path in out.iterdir() if out.is_dir() else []:
        if _written_by_export(path):
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _write_export_record(folder: Path, args: argparse.Namespace) -> None:
    """:data:`EXPORT_RECORD` in ``folder``: what this export is and what it came from."""
    record = {"format": args.format, "model": args.model, "adapter": args.adapter, "dtype": args.dtype,
              "from_nvfp4": args.from_nvfp4, "from_trained_base": args.from_trained_base}
    (folder / EXPORT_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def _replace_export(out: Path, write) -> Path:
    """``write(folder)`` into a new folder beside ``out``; only once it succeeded, the earlier export in
    ``out`` (``_check_paths`` refused anything else) is removed and the new files moved in: an
    unreadable checkpoint or a failed export leaves the earlier one as it was."""
    out = out.expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp:
        write(Path(tmp))
        _clear_earlier_export(out)
        out.mkdir(exist_ok=True)
        for path in Path(tmp).iterdir():
            shutil.move(str(path), str(out / path.name))
    log.info("moved the export into %s", out)  # (the lines above name the folder it was written in)
    return out


# What an unreadable or foreign --adapter checkpoint raises (a one-line CLI error).
_CHECKPOINT_ERRORS = (OSError, RuntimeError, ValueError, TypeError, KeyError, pickle.UnpicklingError)


def _read_checkpoint(parser: argparse.ArgumentParser, path: str) -> dict:
    """:func:`_load_checkpoint` with an unreadable or foreign checkpoint as a one-line CLI error."""
    try:
        return _load_checkpoint(path)
    except _CHECKPOINT_ERRORS as err:
        parser.error(f"cannot read the adapter of --adapter {path}: {err}")


def _checkpoint_adapter(parser: argparse.ArgumentParser, path: str, out: str | Path, ckpt: dict | None = None) -> Path:
    """:func:`adapter_from_checkpoint` (of ``ckpt`` when already read) with an unreadable or foreign
    checkpoint as a one-line CLI error."""
    try:
        return adapter_from_checkpoint(path if ckpt is None else ckpt, out)
    except _CHECKPOINT_ERRORS as err:
        parser.error(f"cannot read the adapter of --adapter {path}: {err}")


def _check_trained_base(parser: argparse.ArgumentParser, args: argparse.Namespace, trained_on: str | None,
                        strict: bool, base: dict | None = None) -> None:
    """--model against the base the adapter records having been trained on. With ``strict`` (a training
    checkpoint's ``model``), two different tiny models are an error: the same shapes, other weights.
    Any other difference is a warning, as it may be the same model by another name (a local copy of
    a hub id); an adapter that does not fit --model's linears is refused when it loads. ``base``: the
    adapter's whole record, which a ``--from-trained-base`` export in --model may hold, dequantized."""
    if not trained_on or same_model(trained_on, args.model) or (base is not None and is_dequantized_base(args.model, base)):
        return
    if strict and trained_on in TINY_MODEL_NAMES and args.model in TINY_MODEL_NAMES:
        parser.error(f"--model {args.model}, but --adapter {args.adapter} was trained on {trained_on}")
    log.warning("--model %s, but --adapter %s was trained on %s: exporting it onto --model (are they the same "
                "model?)", args.model, args.adapter, trained_on)


def _base_quantization(args: argparse.Namespace, trained: str | None, at_home: bool = False) -> str:
    """How to load --model: ``nvfp4`` for an NVFP4 export; for a dense one the original weights, or the
    base the adapter trained on, dequantized (``--from-trained-base``; ``--from-nvfp4``: NVFP4's).
    ``trained``: the quantization the adapter records (None: not recorded); ``at_home``: --model is
    already that base, dequantized (an earlier ``--from-trained-base`` export)."""
    if args.format == "nvfp4":
        if args.adapter and trained in ("bf16", "nf4"):
            log.warning("--adapter was trained on the %s base: in an NVFP4 export it runs on other weights than it "
                        "trained on (--format bf16 --from-trained-base exports that base)", trained)
        return "nvfp4"
    if args.from_nvfp4:
        if args.adapter and trained not in (None, "nvfp4"):
            log.warning("--from-nvfp4: the adapter was trained on the %s base, and runs here on NVFP4 weights "
                        "(--from-trained-base exports the base it trained on)", trained)
        return "nvfp4"
    if at_home:  # (already dequantized: loading it as NVFP4 again would re-quantize it)
        return "bf16"
    if args.from_trained_base:
        return trained or "nvfp4"  # not recorded: the default arm's
    if args.adapter and trained != "bf16":
        what = f"the {trained.upper()} base" if trained else "a base it does not record (NVFP4, the default arm?)"
        log.warning("--format bf16 --adapter: the adapter was trained on %s; --from-trained-base exports that base "
                    "(dequantized) instead of the original 16-bit weights", what)
    return "bf16"


def _base_settings(parser: argparse.ArgumentParser, args: argparse.Namespace,
                   ckpt: dict | None) -> tuple[str, int, str | None, dict | None]:
    """(dtype, seed, quantization, record) of the base the adapter trained on, once --model is checked
    against the adapter's recorded base (quantization None: not recorded; record: the checkpoint's or
    ``qerl_base.json``'s, None when qerl wrote neither); ``ckpt``: the --adapter training checkpoint, read.
    With a training checkpoint, or an adapter directory qerl wrote (``qerl_base.json``), the run's:
    NVFP4 codes of weights loaded (a .gguf dequantized) or randomly initialised in another dtype
    differ, and a tiny model's weights are its seed's; ``--dtype`` then casts only the dense tensors
    written."""
    seed = 0 if args.seed is None else args.seed
    if not args.adapter:
        return args.dtype, seed, None, None
    if ckpt is not None:
        base = checkpoint_base(ckpt)
    else:  # a peft adapter directory (checked by _check_paths)
        try:
            base = read_base(args.adapter)
            named = read_peft_base(args.adapter) if base is None else None
        except (OSError, ValueError) as err:
            parser.error(f"cannot read --adapter {args.adapter}: {err}")
        if base is None:  # not written by qerl: only peft's record of the base's name
            _check_trained_base(parser, args, named, strict=False)
            return args.dtype, seed, None, None
    dtype, quantization = base.get("dtype") or args.dtype, base.get("quantization")
    _check_trained_base(parser, args, base.get("model"), strict=True, base=base)
    if args.model not in TINY_MODEL_NAMES or (base.get("model") or args.model) != args.model:
        return dtype, seed, quantization, base  # the run's seed built another model
    trained = base.get("seed")
    if trained is None:
        if args.seed is None:
            log.warning("%s does not record its tiny model's seed: building seed 0 (else pass --seed)", args.adapter)
        return dtype, seed, quantization, base
    if args.seed is not None and args.seed != trained:
        parser.error(f"--seed {args.seed}, but --adapter {args.adapter} was trained on {args.model} of seed {trained}")
    return dtype, int(trained), quantization, base


class _OneLineErrors(argparse.ArgumentParser):
    """An error is one line on stderr (exit 2), as ``train.py``'s: argparse's usage block above it
    buried the message; ``--help`` has the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> Path:
    """``python -m qerl.export`` on ``argv`` (default: the command line); returns the export folder (printed)."""
    parser = _OneLineErrors(prog="python -m qerl.export", description=qerl.export.__doc__.split("\n\n")[0],
                                     epilog=_CLI_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="tiny-qwen2 | tiny-llama | model dir | HF id | .gguf "
                        "(default: the base a qerl --adapter records)")
    parser.add_argument("--format", choices=["nvfp4", "bf16", "adapter"], default="nvfp4",
                        help="adapter: only the adapter of the --adapter checkpoint")
    parser.add_argument("--out", required=True, help="output directory (new or empty, or see --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace the export already in --out")
    parser.add_argument("--adapter", default=None,
                        help="peft adapter dir (written by export_adapter / save_pretrained) or a training .ckpt")
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                        help="dtype of the dense tensors (default bf16; a training .ckpt's base is built in its own "
                             "dtype first; fp32 keeps an fp32 run's exactly)")
    parser.add_argument("--device", default=None, help="where to quantize (default cpu; cuda is faster for big models)")
    parser.add_argument("--from-nvfp4", action="store_true",
                        help="with --format bf16: export the dequantized NVFP4 weights instead of the originals")
    parser.add_argument("--from-trained-base", action="store_true",
                        help="with --format bf16 --adapter: export the base the adapter trained on (NVFP4 or NF4 "
                             "dequantized, bf16 as is), so the export gives the trained model's outputs")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the tiny random models (default: a training .ckpt's, else 0)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _check_paths(parser, args)
    if args.format == "adapter":
        def write_adapter(tmp: Path) -> None:
            _checkpoint_adapter(parser, args.adapter, tmp)
            _write_export_record(tmp, args)

        out = _replace_export(Path(args.out), write_adapter)
        print(out)
        return out
    ckpt = _read_checkpoint(parser, args.adapter) if str(args.adapter or "").endswith(".ckpt") else None  # (once)
    if not args.model:
        args.model = _model_from_the_adapter(parser, args, ckpt)
        _check_out_is_not_the_model(parser, args)
    base_dtype, seed, trained_quantization, recorded = _base_settings(parser, args, ckpt)
    at_home = recorded is not None and is_dequantized_base(args.model, recorded)  # (then it records what it is)
    dequantized_from = read_dequantized_base(args.model) if at_home else None
    quantization = _base_quantization(args, trained_quantization, at_home)
    try:
        model, tokenizer = load_policy(args.model, quantization, None, dtype=base_dtype, device=args.device, seed=seed)
    except (OSError, ValueError, ImportError) as err:  # unknown model path / id, unreadable GGUF, nf4 without its library
        parser.error(f"cannot load --model {args.model} as {quantization}: {err}")
    base_norms = {}
    if args.adapter:
        with tempfile.TemporaryDirectory() as tmp:
            try:  # an adapter that does not fit --model (trained on another base): one line
                adapter = args.adapter if ckpt is None else _checkpoint_adapter(parser, args.adapter, tmp, ckpt)
                if (Path(adapter) / TRAINABLE_NORMS_FILE).is_file():  # (before the adapter's replace them)
                    base_norms = base_norm_scales(model, args.model)
                model = load_adapter(model, adapter)
            except (ValueError, OSError, SafetensorError) as err:  # (a file that cannot be read: named by err)
                parser.error(f"cannot load --adapter {args.adapter} onto --model {args.model}: "
                             f"{' '.join(str(err).split())}")
    export = export_nvfp4 if args.format == "nvfp4" else export_bf16

    def write(tmp: Path) -> None:
        export(model, tokenizer, tmp, dtype=args.dtype)
        _write_export_record(tmp, args)
        if args.format == "bf16" and (args.from_trained_base or at_home) and not args.from_nvfp4:  # that base:
            # an adapter trained on it is at home here
            write_dequantized_base(tmp, dequantized_from or {"model": args.model, "dtype": base_dtype, "seed": seed,
                                                             "quantization": quantization})
        if base_norms and args.format == "bf16":  # the adapter's trained norms are in the weights: the base's beside
            (tmp / BASE_NORMS_DIR).mkdir()
            save_file({k: v.cpu().contiguous() for k, v in base_norms.items()}, str(tmp / BASE_NORMS_FILE))
        if args.adapter and (tmp / ADAPTER_SUBDIR).is_dir():  # for a later export: the base the adapter
            # trained on, as recorded (an export onto another base or folder does not change that)
            _write_base(tmp / ADAPTER_SUBDIR, recorded or {"model": args.model, "dtype": base_dtype, "seed": seed,
                                                           "quantization": trained_quantization})
    try:
        out = _replace_export(Path(args.out), write)
    except OSError as err:  # (a folder the checks cannot see is read-only, /proc; a full disk)
        parser.error(f"cannot write --out {args.out}: {' '.join(str(err).split())}")
    warn_if_auto_tokenizer_differs(tokenizer, out)  # (a tiny test model's: AutoTokenizer drops its spaces)
    print(out)
    return out
