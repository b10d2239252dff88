# Every target sets itself up: a fresh machine needs only Python 3.11+.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
EXTRAS ?= dev,flax,bench

.PHONY: install test lint demo bench bench-quick clean

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[$(EXTRAS)]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 --dist loadfile

demo: $(STAMP)
	$(BIN)/python examples/demo.py
	$(BIN)/python examples/skip_bad_steps_demo.py

# The loss-scaling benchmark (under 10 minutes on 2 cores); ARGS=--quick for a CI-size run.
bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(ARGS)

bench-quick: $(STAMP)
	$(BIN)/python -m benchmarks.run --quick

clean:
	rm -rf $(VENV) build dist *.egg-info
