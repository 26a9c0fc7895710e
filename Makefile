# Two commands for a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# GPU workers of `make fleet` / `make compose`, and seconds between two engines' first starts.
GPUS ?= 7
# GPUs of one tensor-parallel engine: GPUS=8 GPUS_PER_ENGINE=2 gives workers gpu0-1 ... gpu6-7.
GPUS_PER_ENGINE ?= 1
STAGGER ?= 30
# pytest-xdist workers of `make test`: most tests wait on real processes (Redis, Celery
# workers, simulators), so a few more workers than cores still pays on a 2-core machine
# (measured 2026-12-03 on 2 cores: 3 workers 683 s, 4 workers 582-606 s, CPU 96 % busy).
TEST_WORKERS ?= 4
# Minutes `make soak` keeps running fault-and-operator schedules (tests/chaos/).
SOAK_MINUTES ?= 30

.PHONY: install lock redis-bin chromium-bin trainers-venv demo test lint bench gpu-check soak fleet compose procfile clean

# Exact versions with hashes from requirements.lock, then the project itself without
# resolving anything again.
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements.lock
	python3 -m venv $(VENV)
	$(PIP) install -q -U pip
	$(PIP) install -q --require-hashes -r requirements.lock
	$(PIP) install -q --no-deps -e .
	touch $@

# The one command that regenerates requirements.lock (base + dev extras, CPython 3.11 on
# x86_64 Linux) after a change to the dependencies in pyproject.toml.
UV_VERSION ?= 0.13.9
lock:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q uv==$(UV_VERSION)
	$(VENV)/bin/uv pip compile -q pyproject.toml --extra dev --generate-hashes \
	  --python-version 3.11 --python-platform x86_64-unknown-linux-gnu -o requirements.lock

# The embedded Redis is Debian's redis-server binary (installed here if missing).
redis-bin:
	@command -v redis-server >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server)

# The Flower browser test drives Debian's chromium through the Python playwright package
# (installed by `install`); `playwright install` is never run.
chromium-bin:
	@command -v chromium >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

demo: install redis-bin
	$(PY) -m producer.demo

# SpecForge and speculators (tests/test_export_loaders.py) run in a venv of their own with a CPU
# torch, built once per tools/trainers.lock under ~/.cache (about 70 s and 1.5 GB the first time).
trainers-venv:
	bash tools/trainers_venv.sh >/dev/null

test: install redis-bin chromium-bin trainers-venv
	$(PY) tools/check_lock.py
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=10

lint: install
	$(PY) -m ruff check .

bench: install redis-bin
	$(PY) -m bench.run_all

# The whole fleet on this node's GPUs with real SGLang (the `gpu` extra): one worker per GPU,
# a job, verify, the data set, optional plain-client and engine-kill phases; the summary goes to
# bench/results/. Never part of `make test`. Example:
#   make gpu-check GPU_CHECK_ARGS="--profile qwen36-27b --prompts 2000 --plain 48,96"
#   make gpu-check GPU_CHECK_ARGS="--profile qwen36-27b --plain 96 --plain-before --anchor"
#   (the plain client before and after the fleet, then SGLang's bench_offline_throughput)
GPU_CHECK_ARGS ?= --profile qwen36-27b
gpu-check: install redis-bin
	$(PY) -c "import sglang" 2>/dev/null || $(PIP) install -q -e '.[gpu]'
	$(PY) -m bench.gpu_check $(GPU_CHECK_ARGS)

# Seeded schedules of faults and operator actions against a local fleet (the tests marked
# `soak`, which `make test` leaves out), one after another for SOAK_MINUTES; prints schedules, faults, actions, prompts, lost, duplicated and failing seeds.
soak: install redis-bin
	$(PY) -m tests.chaos.soak --minutes $(SOAK_MINUTES)

# Without containers: redis, flower, sink and GPUS workers under honcho (reads .env), from a
# Procfile generated into .fleet/ (the committed Procfile is the same for GPUS=7).
fleet: install redis-bin
	$(PY) -m deploy.procfile_gen --gpus $(GPUS) --gpus-per-engine $(GPUS_PER_ENGINE) \
	  --stagger-s $(STAGGER) --out .fleet/Procfile
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/honcho -f .fleet/Procfile -d . start

# Rewrite docker-compose.yml / Procfile for another GPU count (docs/runbook.md).
compose: install
	$(PY) -m deploy.compose_gen --gpus $(GPUS) --gpus-per-engine $(GPUS_PER_ENGINE) --stagger-s $(STAGGER)

procfile: install
	$(PY) -m deploy.procfile_gen --gpus $(GPUS) --gpus-per-engine $(GPUS_PER_ENGINE) --stagger-s $(STAGGER)

clean:
	rm -rf $(VENV) .demo .fleet fleet-data logs .pytest_cache
