# clbench developer commands. `make help` lists them.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install run test test-all docs bench table gpu-check gpu-test gpu-test-steps gpu-test-runs gpu-bench \
	gpu-bench-micro gpu-l2p gpu-window gpu-window-dry weights lint format clean

help:  ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-15s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,docs]'
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install clbench with the dev and docs tools

run: $(STAMP)  ## the embedded default: finetune on sklearn digits (5 tasks), vit_micro, CPU, ~1 minute
	$(VENV)/bin/clbench $(ARGS)
	@printf '\n%s\n' "Run clbench yourself: source $(VENV)/bin/activate, then clbench --help (or call $(VENV)/bin/clbench)"

# Tests run in parallel (pytest-xdist), a worker a core (4 at most), each with one torch thread: on 2 cores this took
# the default suite from 14:57 (one process, two threads) to 11:46 and 12:30 (two runs).
TEST_ENV = HF_HUB_OFFLINE=1 WANDB_MODE=offline OMP_NUM_THREADS=1
TEST_PAR = -n auto --maxprocesses 4

test: $(STAMP)  ## the fast test suite (about 12 minutes on 2 CPU cores)
	$(TEST_ENV) $(PY) -m pytest -q $(TEST_PAR) --durations=15 $(ARGS)

test-all: $(STAMP)  ## every test, slow ones included
	$(TEST_ENV) $(PY) -m pytest -q $(TEST_PAR) -m 'not gpu' $(ARGS)

docs: $(STAMP)  ## build the docs site into site/ (strict: a broken link or page fails); serve: .venv/bin/mkdocs serve
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict $(ARGS)

bench: $(STAMP)  ## step throughput of every method vs plain timm references -> bench.json (vit_micro on CPU)
	HF_HUB_OFFLINE=1 $(PY) -m clbench.bench $(ARGS)

table: $(STAMP)  ## run every method on the embedded default (5 and 3 tasks) and rewrite the README's method tables
	HF_HUB_OFFLINE=1 $(PY) -m clbench.method_table --readme README.md $(ARGS)

# On a GPU machine without the venv (e.g. torch preinstalled, the rest carried as wheels):
#   make gpu-check GPU_PY=python3   (with clbench importable: PYTHONPATH=src or an installed wheel)
# Measured on an H100 (2026-11-24): the gpu suite takes about 10 minutes, each bench entry 40-65 s (its own process,
# compiling included). Where a command may run 10 minutes, run gpu-test as its two halves, and the bench targets
# again until they say they are complete: they stop before 9 minutes and go on from their JSON (--resume).
GPU_PY ?= $(PY)
GPU_ENV := HF_HUB_OFFLINE=1 WANDB_MODE=offline
GPU_TESTS = $(GPU_ENV) $(GPU_PY) -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py
GPU_STEPS := steps_and_evaluation or cuda_fp32 or attention_runs_fused
GPU_BENCH = $(GPU_ENV) $(GPU_PY) -m clbench.bench --resume --time-limit 540
define need_cuda
	@command -v $(GPU_PY) >/dev/null || { echo "make $@: no Python at GPU_PY=$(GPU_PY): run make install first \
	(it creates $(VENV)), or pass GPU_PY=python3 (torch installed, clbench importable: PYTHONPATH=src)." >&2; exit 2; }; \
	$(GPU_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
	'make $@ needs a CUDA GPU: torch ' + torch.__version__ + ' sees none on this machine. ' \
	'Run it where one is, e.g. make $@ GPU_PY=python3 (clbench importable).')"
endef

gpu-check: gpu-test gpu-bench gpu-bench-micro gpu-l2p  ## on a CUDA GPU: every gpu-* target in turn

gpu-test: gpu-test-steps gpu-test-runs  ## on a CUDA GPU: the gpu suite (every method's step, graphs, compile, DDP, resume)

gpu-test-steps:  ## on a CUDA GPU: its first half: every method's steps, CPU agreement, fused attention (~6 min on an H100)
	$(need_cuda)
	$(GPU_TESTS) -k "$(GPU_STEPS)" $(ARGS)

gpu-test-runs:  ## on a CUDA GPU: its second half: host syncs, compiled graphs, DDP, streaming, zero forgetting, resume
	$(need_cuda)
	$(GPU_TESTS) -k "not ($(GPU_STEPS))" $(ARGS)

gpu-bench:  ## on a CUDA GPU: make bench at ViT-B/16 (224 px, batch 128, bf16) into bench.json; again until complete
	$(need_cuda)
	$(GPU_BENCH) --out bench.json $(ARGS)

gpu-bench-micro:  ## on a CUDA GPU: every method and timm at the micro ViT's shape (32 px, batch 32) into bench_micro.json
	$(need_cuda)
	$(GPU_BENCH) --backbone vit_micro --image-size 32 --batch-size 32 --out bench_micro.json \
	  --methods $$($(GPU_PY) -c "from clbench.methods import TRAINED; print(*TRAINED)") \
	  reference/timm_train reference/timm_compiled $(ARGS)

gpu-l2p:  ## on a CUDA GPU: L2P's paper protocol on synthetic CIFAR-100 (ViT-B/16), its wall time
	$(need_cuda)
	@rm -rf outputs/gpu-check/l2p; start=$$(date +%s); $(GPU_ENV) $(GPU_PY) -m clbench experiment=l2p_cifar100_paper \
	  data=synthetic_cifar100 backbone.pretrained=false logger.mode=disabled hydra.run.dir=outputs/gpu-check/l2p \
	  && echo "L2P protocol (synthetic CIFAR-100, 10 tasks, ViT-B/16): $$(( $$(date +%s) - start )) s (target <= 120 s)"

# A lent GPU window is 15 minutes in all, 10 a command: gpu-window is one command that stops within 8 minutes (its
# smoke of every method, then the ViT-B/16 bench of every method in one process), writing JSON under $$OUT
# (default gpu-window/). gpu-window-dry runs the same command here, its GPU parts stubbed out, and times it.
gpu-window:  ## on a CUDA GPU: one window's checks in <= 8 min (every method's smoke, the ViT-B/16 bench) into $OUT
	$(need_cuda)
	$(GPU_ENV) $(GPU_PY) -m clbench.bench.window $(ARGS)

gpu-window-dry: $(STAMP)  ## gpu-window's command without a GPU (GPU parts stubbed out), timed: into gpu-window-dry/
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(PY) -m clbench.bench.window --dry-run --out gpu-window-dry $(ARGS)

weights: $(STAMP)  ## regenerate the shipped micro-ViT weights bit for bit (stroke-glyph pretraining, CPU)
	$(PY) -m clbench.pretraining.vit_micro $(ARGS)

lint: $(STAMP)  ## ruff check + format check
	$(VENV)/bin/ruff check src tests docs/examples docs/hooks
	$(VENV)/bin/ruff format --check src tests docs/examples docs/hooks

format: $(STAMP)  ## apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix src tests docs/examples docs/hooks
	$(VENV)/bin/ruff format src tests docs/examples docs/hooks

clean:  ## remove caches and build outputs (keeps .venv and outputs/)
	rm -rf build dist site .pytest_cache .ruff_cache src/*.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
