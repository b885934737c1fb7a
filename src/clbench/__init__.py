"""clbench: continual-learning experiments on Vision Transformers under one protocol."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("clbench")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"
