# `make train` and `make test` create the environment on first use; `make install` does only that.
# The environment is exactly uv.lock (the versions CI tested): `uv sync --locked` refuses a lock that no longer
# matches pyproject.toml, so a dependency changed without `make lock` fails here, and in CI.
VENV ?= .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
UV_VERSION := 0.13.8

.PHONY: install lock train test test-fast lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml uv.lock tests/azurite/package-lock.json
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet uv==$(UV_VERSION)
	UV_PROJECT_ENVIRONMENT=$(VENV) $(UV) sync --quiet --locked --inexact --compile-bytecode --extra dev --python $(PY)
	$(MAKE) --no-print-directory $(VENV)/azurite
	touch $@

# Azure Blob's API for the az:// tests (Azurite, an npm package: Node.js's npm, as locked); without npm those tests
# skip, saying so
$(VENV)/azurite: tests/azurite/package-lock.json
	@if command -v npm >/dev/null; then \
		mkdir -p $@ && cp tests/azurite/package.json tests/azurite/package-lock.json $@/ && \
		npm ci --silent --no-audit --no-fund --prefix $@ && touch $@; \
	else echo "npm not found: the az:// tests will skip (Debian: apt-get install npm)"; fi

# After a change to the dependencies in pyproject.toml: re-resolve uv.lock (then `make install`).
lock:
	@test -x $(UV) || (python3 -m venv $(VENV) && $(VENV)/bin/pip install --quiet uv==$(UV_VERSION))
	$(UV) lock

train: install
	$(PY) train.py

# Two test files at a time (pytest-xdist; a file's tests and module fixtures stay in one worker): most runs are
# 2 processes that wait on each other or on startup, so two files keep 2 cores busy. TEST_WORKERS=0: one at a time.
TEST_WORKERS ?= 2

test: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

test-fast: install
	$(PY) -m pytest -m "not slow"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: install
	$(PY) -m benchmarks.run_all

clean:
	rm -rf logs outputs multirun .pytest_cache
