# `make train` and `make test` create the environment on first use; `make install` does only that.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch/torchvision pinned to the builds this starter is tested with (CUDA wheels that also run on CPU).
TORCH := torch==2.14.1 torchvision==0.29.1

.PHONY: install train test test-fast lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet $(TORCH)
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $@

train: install
	$(PY) train.py

test: install
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not slow"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: install
	$(PY) -m benchmarks.run_all

clean:
	rm -rf logs outputs multirun .pytest_cache
