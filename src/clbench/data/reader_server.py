"""Imported by the reader workers' fork server alone (its preload, :func:`clbench.data.stream.worker_context`), never
by the training process: it holds SIGINT and SIGTERM (blocks them) in the fork server. A forked process inherits its
parent's signal mask, so every reader worker is born with the stop signals held: one that reaches it before it has set
its handlers (:func:`clbench.data.stream.ignore_stop_signals`, which then lets them through) waits, pending, instead of
killing it with the default action. The fork server itself then outlives them too (it ends when the training process
does)."""

import signal

from clbench.data.stream import STOP_SIGNALS

signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
