"""Dump a run's TensorBoard scalars to JSON and print a per-step table (for notes and results files).

    python benchmarks/tb_scalars.py LOG_DIR [--out run.json] [--tags train/reward,time/generate,...]

Reads every ``events.out.tfevents.*`` under LOG_DIR (e.g. ``logs/<name>/version_0``); the JSON maps
each tag to ``[[step, value], ...]``.
"""

import argparse
import glob
import json
import os

DEFAULT_TAGS = ("train/reward", "train/entropy", "train/is_ratio/mean", "aqn/sigma", "train/completion_length/mean",
                "time/sync", "time/generate", "time/train")


def _created(path: str) -> tuple[float, str]:
    """An event file's creation time: the Unix time in its name (events.out.tfevents.<time>.<host>...)."""
    try:
        return float(os.path.basename(path).split(".")[3]), path
    except (IndexError, ValueError):
        return os.path.getmtime(path), path


def read_scalars(log_dir: str) -> dict[str, list[list[float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True),
                   key=_created)  # oldest first (version_10 after version_2): a re-logged step's later value wins
    if not files:
        raise SystemExit(f"no TensorBoard event file under {log_dir}")
    out: dict[str, list[list[float]]] = {}
    for path in files:
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend([e.step, e.value] for e in acc.Scalars(tag))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log_dir")
    ap.add_argument("--out")
    ap.add_argument("--tags", default=",".join(DEFAULT_TAGS))
    args = ap.parse_args()
    scalars = read_scalars(args.log_dir)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(scalars, f, indent=1)
    tags = [t for t in args.tags.split(",") if t in scalars]
    steps = sorted({int(s) for t in tags for s, _ in scalars[t]})
    print("| step | " + " | ".join(tags) + " |\n|" + "---|" * (len(tags) + 1))
    latest = {t: {int(s): v for s, v in scalars[t]} for t in tags}  # a step logged twice (resume): the later value
    for step in steps:
        vals = [f"{latest[t][step]:.4g}" if step in latest[t] else "" for t in tags]
        print(f"| {step} | " + " | ".join(vals) + " |")


if __name__ == "__main__":
    main()
