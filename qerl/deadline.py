"""A wall-clock deadline around one call, for reward code that runs on arbitrary model output.

math-verify 0.9's own timeouts use ``signal.alarm`` with whole seconds and raise ValueError outside
the main thread; ``qerl.rewards`` disables them and wraps each parse + verify in :func:`call_with_deadline`
instead (one sub-second ``setitimer``, main thread only).
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


class _DeadlineExceeded(BaseException):
    """Raised by the SIGALRM handler. A BaseException so math-verify's ``except Exception``
    blocks cannot swallow it and keep computing after the deadline."""


def _raise_deadline(signum: int, frame: Any) -> None:
    raise _DeadlineExceeded()


def _can_use_alarm() -> bool:
    """SIGALRM works only in the main thread and only if no one else has an interval timer armed
    (we would clobber it)."""
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0.0
    )


_LONGEST_TIMER_S = 1e6  # ~11.6 days: any longer limit is no limit


def call_with_deadline(fn: Callable[[], _T], seconds: float) -> _T:
    """Run ``fn()`` and raise TimeoutError if it takes longer than ``seconds`` of wall time.

    math-verify 0.9's own timeouts use ``signal.alarm`` with whole seconds and raise ValueError
    outside the main thread, so we disable them (``None``) and arm one sub-second ``setitimer``
    around parse+verify ourselves. Python delivers the signal between bytecodes, so work in Python loops
    stops on time: sympy on ``9^{9^{9^9}}`` or ``99999999!`` against an integer gold was measured to. One
    C-level operation does not: math-verify's numeric check of a power with a huge exponent
    (``10^{10^{10^{10}}}`` against ``y^2``) shifts a big integer by ~10^10 bits inside mpmath, 10-19 s
    and ~9 GB past a 2 s deadline. ``MathAccuracy`` keeps such numbers from math-verify beforehand
    (``qerl.huge_power.has_huge_power``); this deadline does not bound them.
    Outside the main thread no signal can be used: there only the input-length caps bound the cost.
    """
    if seconds <= 0 or seconds > _LONGEST_TIMER_S or not _can_use_alarm():
        return fn()  # 0 / inf mean "no limit" (setitimer itself overflows past ~9e9 s)
    old_handler = signal.signal(signal.SIGALRM, _raise_deadline)
    old_hook = sys.unraisablehook
    sys.unraisablehook = functools.partial(_drop_deadline_unraisable, old_hook)
    try:
        try:
            # Re-fires every 50 ms after the deadline in case some library code swallows the first
            # exception with a bare `except:`; the inner `finally` disarms it either way.
            signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _DeadlineExceeded:
        # Also catches a signal that fires inside the inner `finally`, before the timer is cleared.
        raise TimeoutError(f"exceeded {seconds:.2f}s") from None
    finally:
        signal.signal(signal.SIGALRM, old_handler)
        sys.unraisablehook = old_hook


def _drop_deadline_unraisable(previous_hook: Callable[[Any], None], unraisable: Any) -> None:
    """``sys.unraisablehook`` while a deadline is armed. A signal that lands inside a finalizer
    (``__del__``, a generator closed by the garbage collector) cannot propagate: Python reports it
    as "unraisable" and goes on. That one is expected and dropped (the timer re-fires 50 ms later in
    ordinary code); anything else goes to the previous hook."""
    if not isinstance(unraisable.exc_value, _DeadlineExceeded):
        previous_hook(unraisable)
