"""Continual-learning methods: one file each, selected by ``method=<name>`` (conf/method/<name>.yaml)."""

from clbench.methods.base import Method, Phase

# Every method clbench ships, in the README's order: those that train (reference points, the mask methods, the prompt
# methods, the rest of the mask survey), then SimpleCIL, which only observes.
TRAINED = (
    "finetune",
    "joint",
    "packnet",
    "piggyback",
    "supsup",
    "hat",
    "meat",
    "l2p",
    "dualprompt",
    "coda_prompt",
    "apd",
    "ctr",
    "ksm",
    "tfm",
)
METHODS = (*TRAINED, "simplecil")

__all__ = ["METHODS", "TRAINED", "Method", "Phase"]
