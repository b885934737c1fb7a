"""Continual-learning methods: one file each, selected by ``method=<name>`` (conf/method/<name>.yaml)."""

from clbench.methods.base import Method, Phase

__all__ = ["Method", "Phase"]
