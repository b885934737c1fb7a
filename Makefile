# clbench developer commands. `make help` lists them.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install run test test-all bench gpu-check weights lint format clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-9s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install clbench with the dev tools

run: $(STAMP)  ## the embedded default: finetune on sklearn digits (5 tasks), vit_micro, CPU, ~1 minute
	$(VENV)/bin/clbench $(ARGS)

test: $(STAMP)  ## the fast test suite (minutes on 2 CPU cores)
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(PY) -m pytest -q $(ARGS)

test-all: $(STAMP)  ## every test, slow ones included
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(PY) -m pytest -q -m 'not gpu' $(ARGS)

bench: $(STAMP)  ## step throughput of every method vs plain timm references -> bench.json (vit_micro on CPU)
	HF_HUB_OFFLINE=1 $(PY) -m clbench.bench $(ARGS)

# On a GPU machine without the venv (e.g. torch preinstalled, the rest carried as wheels):
#   make gpu-check GPU_PY=python3   (with clbench importable: PYTHONPATH=src or an installed wheel)
GPU_PY ?= $(PY)
gpu-check:  ## on a CUDA GPU: the gpu tests, make bench (ViT-B/16, 224 px, bf16), the L2P protocol timed
	@$(GPU_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
	'make gpu-check needs a CUDA GPU: torch ' + torch.__version__ + ' sees none on this machine. ' \
	'Run it where one is, e.g. make gpu-check GPU_PY=python3 (clbench importable).')"
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(GPU_PY) -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py
	HF_HUB_OFFLINE=1 $(GPU_PY) -m clbench.bench --out bench.json $(ARGS)
	@start=$$(date +%s); HF_HUB_OFFLINE=1 WANDB_MODE=offline $(GPU_PY) -m clbench experiment=l2p_cifar100_paper \
	  data=synthetic_cifar100 backbone.pretrained=false logger.mode=disabled hydra.run.dir=outputs/gpu-check/l2p \
	  && echo "L2P protocol (synthetic CIFAR-100, 10 tasks, ViT-B/16): $$(( $$(date +%s) - start )) s (target <= 180 s)"

weights: $(STAMP)  ## regenerate the shipped micro-ViT weights bit for bit (stroke-glyph pretraining, CPU)
	$(PY) -m clbench.pretraining.vit_micro $(ARGS)

lint: $(STAMP)  ## ruff check + format check
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

format: $(STAMP)  ## apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix src tests
	$(VENV)/bin/ruff format src tests

clean:  ## remove caches and build outputs (keeps .venv and outputs/)
	rm -rf build dist .pytest_cache .ruff_cache src/*.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
