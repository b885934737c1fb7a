"""The one training loop, in stages: :mod:`~clbench.loop.run` (the run, top to bottom), :mod:`~clbench.loop.task`
(a task's phases and epochs), :mod:`~clbench.loop.step` (one step: eager, compiled or a CUDA graph),
:mod:`~clbench.loop.optim` (optimizer and schedule), :mod:`~clbench.loop.runtime` (device, data, transforms and how
the step runs), :mod:`~clbench.loop.resume` and :mod:`~clbench.loop.signals`."""

from clbench.loop.run import train

__all__ = ["train"]
