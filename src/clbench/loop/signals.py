"""Stop signals while training: recorded, then acted on between steps (a checkpoint, then a clean stop)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def stop_signals() -> Iterator[Callable[[], int | None]]:
    """While training, SIGTERM and SIGINT (SLURM preemption, Ctrl-C) only record the signal, which the loop reads
    after each step, so it can write a checkpoint and stop cleanly. SIGUSR2 (submitit's time-limit and preemption
    signal) is caught too where a launcher installed a handler for it; the CLI hands it on after the checkpoint,
    so the launcher requeues the job."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    raised: list[int] = []
    requeue = [signal.SIGUSR2] if callable(signal.getsignal(signal.SIGUSR2)) else []
    previous = {
        sig: signal.signal(sig, lambda signum, _frame: raised.append(signum)) for sig in (*STOP_SIGNALS, *requeue)
    }
    try:
        yield lambda: raised[0] if raised else None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
