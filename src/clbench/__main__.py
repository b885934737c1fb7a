"""`python -m clbench` is the same as the `clbench` console script."""

from clbench.cli import main

main()
