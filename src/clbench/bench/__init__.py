"""`make bench`: the training step of every method against plain timm references, and the data path; see
:mod:`clbench.bench.cli`."""
