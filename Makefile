# Two commands for a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install redis-bin demo test lint bench fleet clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q -U pip
	$(PIP) install -q -e '.[dev]'
	touch $@

# The embedded Redis is Debian's redis-server binary (installed here if missing).
redis-bin:
	@command -v redis-server >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server)

demo: install redis-bin
	$(PY) -m producer.demo

test: install redis-bin
	$(PY) -m ruff check .
	$(PY) -m pytest -q

lint: install
	$(PY) -m ruff check .

bench: install redis-bin
	$(PY) -m bench.run_all

fleet: install redis-bin
	GPUS=$${GPUS:-7} $(VENV)/bin/honcho start

clean:
	rm -rf $(VENV) .demo fleet-data logs .pytest_cache
