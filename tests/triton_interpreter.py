"""Running a test script through Triton's CPU interpreter (``TRITON_INTERPRET=1`` must be set
before Triton is imported, so the script runs in a subprocess)."""

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ready() -> bool:
    """Triton importable and a NumPy its interpreter works with (< 2.4)."""
    if importlib.util.find_spec("triton") is None:
        return False
    import numpy
    return tuple(int(v) for v in numpy.__version__.split(".")[:2]) < (2, 4)


REASON = "needs triton and numpy<2.4 for the CPU interpreter"


def run(script: str, done: str, timeout: int = 600) -> None:
    """Run ``script`` interpreted (the repository and tests/ importable); it must print ``done``."""
    path = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert r.returncode == 0 and done in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
