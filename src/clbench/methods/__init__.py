"""Continual-learning methods: one file each, selected by ``method=<name>`` (conf/method/<name>.yaml)."""

from clbench.methods.base import Method, Phase

# The rows the founding papers' tables compare against (L2P Table 1, MEAT Table 1): regularisation, rehearsal and
# parameter-isolation baselines.
BASELINES = ("ewc", "lwf", "er", "derpp", "gdumb", "bic", "individual", "classifier", "adapter")
# The pretrained-model era's methods: adapt a pretrained ViT through a parameter-efficient module (APER and RanPAC in
# the first session only, EASE a new one every task), the whole ViT slowly (SLCA) or a low-rank update of its attention
# a task (SD-LoRA, InfLoRA), then classify over its features (MIN through noise layers it learns; MOS through the
# adapter a prototype classifier and its head pick) without exemplars; TUNA scores the least-entropy task adapter beside
# one merged from every task's; HiDe-Prompt infers the task first, then reads that task's prompt (or LoRA) slot.
PTM_METHODS = ("aper", "ranpac", "slca", "sdlora", "inflora", "min", "ease", "mos", "tuna", "hide")
# Every method clbench ships, in the README's order: those that train (reference points, the mask methods, the prompt
# methods, the rest of the mask survey, the baselines, the pretrained-model era's), then SimpleCIL, which only observes.
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
    *BASELINES,
    *PTM_METHODS,
)
METHODS = (*TRAINED, "simplecil")

__all__ = ["BASELINES", "METHODS", "PTM_METHODS", "TRAINED", "Method", "Phase"]
