"""Benchmarks: ordered tasks of disjoint classes, held as uint8 tensors and augmented in batches on the device."""

from clbench.data.benchmark import Benchmark, Split, Task, build_benchmark
from clbench.data.transforms import DeviceTransform

__all__ = ["Benchmark", "DeviceTransform", "Split", "Task", "build_benchmark"]
