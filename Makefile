# Every target sets itself up: a fresh machine needs only Python 3.11+.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
EXTRAS ?= dev,flax,bench,equinox,libraries

.PHONY: install test test-examples test-extended lint demo bench bench-quick clean docs dist-check
.PHONY: test-compat test-lowest test-py312 test-py313 test-newest test-jax011 constraints-lowest
.PHONY: constraints-newest

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[$(EXTRAS)]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# `make test`: ruff, then every test but the end-to-end runs of the examples,
# the notebooks and the benchmark scripts, which `make test-examples` runs
# (each in its quick mode). CI (`.ci/run`) runs both.
EXAMPLE_TESTS := $(addprefix tests/,test_demo.py test_skip_bad_steps_demo.py \
  test_fp16_rl_example.py test_fp8_example.py test_notebooks.py test_benchmarks.py)

# `make test` also leaves out the long runs, which `make test-extended` runs
# (CI runs it too), to stay under 10 minutes on 2 cores: the autocast corpus
# (about 850 real JAX functions in float16 and bfloat16), the third-party
# libraries under autocast (Equinox's primitives, diffrax, e3nn-jax), the
# whole models under autocast (test_autocast_models.py: about a minute), fp8
# autocast (test_fp8_autocast.py: a small GPT trained with every product in
# fp8 among them, a minute), the suite collected without flax installed
# (test_flax_optional.py, a subprocess: 17 s), the simulated 8-device
# sessions, and the files that each took 20 s or more of a worker's time on a
# slow day (2026-11-28: `make test` took 11 minutes with them, against 6-7 on
# earlier days): autocast's op-by-op cases and fp8 controls, the Flax and
# Equinox integrations, the peers' migration tables, the long runs, the
# profiled dispatch and the unscaled-gradient warnings.
EXTENDED_TESTS := $(addprefix tests/,test_autocast_corpus.py test_autocast_corpus_bf16.py \
  test_autocast_libraries.py test_autocast_models.py test_fp8_autocast.py \
  test_flax_optional.py test_multi_device.py \
  test_autocast_ops.py test_fp8_control.py test_low_precision_flax.py test_equinox.py \
  test_migration.py test_long_runs.py test_dispatch.py test_unscaled_gradients.py)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -n 2 --dist loadfile $(addprefix --ignore=,$(EXAMPLE_TESTS) $(EXTENDED_TESTS))

test-extended: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile $(EXTENDED_TESTS)

test-examples: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile $(EXAMPLE_TESTS)

demo: $(STAMP)
	$(BIN)/python examples/demo.py
	$(BIN)/python examples/skip_bad_steps_demo.py

# The loss-scaling benchmark (under 10 minutes on 2 cores); ARGS=--quick for a CI-size run.
bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(ARGS)

bench-quick: $(STAMP)
	$(BIN)/python -m benchmarks.run --quick

# The documentation site, into docs/_build/html: every warning is an error and
# every reference must resolve (nitpicky). The notebooks are executed, so their
# pages show outputs and plots; NB_EXECUTION_MODE=off skips that (the test
# suite executes them anyway).
DOCS_STAMP := $(VENV)/.docs-stamp
$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[$(EXTRAS),docs]'
	touch $@

docs: $(DOCS_STAMP)
	$(BIN)/sphinx-build -W --keep-going -b html docs docs/_build/html

# Builds the wheel and the sdist (hatchling pinned by constraints.txt), checks
# their metadata and contents, installs the wheel into a fresh environment of
# its own (the runtime dependencies only) and imports the package from there.
DIST_DEPS := build twine
DIST_VENV := .venv-dist
$(VENV)/.dist-stamp: $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt $(DIST_DEPS)
	touch $@

dist-check: $(VENV)/.dist-stamp
	rm -rf dist $(DIST_VENV)
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(BIN)/python -m build --outdir dist
	$(BIN)/twine check --strict dist/*
	$(BIN)/python .ci/check_dist.py dist
	$(PYTHON) -m venv $(DIST_VENV)
	$(DIST_VENV)/bin/python -m pip install --quiet -c constraints.txt dist/*.whl
	cd dist && ../$(DIST_VENV)/bin/python -I ../.ci/check_dist.py --import

# The other ends of the supported range, each in a virtual environment of its
# own; `.ci/run` runs them after `make test` (the pinned set on Python 3.11).
# On the lowest versions: the whole suite but what needs the pinned set: the
# notebooks, the demos and the benchmarks (their extras are not installed),
# the compiled-HLO facts (XLA-version specific), and the multi-device and
# multi-process sessions (they use `jax.reshard`, `jax.distributed` options and
# the sharding propagation of newer jax).
LOWEST_IGNORE := $(addprefix --ignore=tests/,test_notebooks.py test_demo.py \
  test_skip_bad_steps_demo.py test_fp16_rl_example.py test_benchmarks.py test_compiled_step.py \
  test_multi_device.py test_multi_process.py multidevice)
# On Python 3.12 and 3.13: the loss scales, the wrapper, skip_bad_steps and the
# doctests, the code that a new Python could break; CI time allows no more.
PY_TESTS := tests/test_loss_scale.py tests/test_optimizer.py tests/test_apply_gradients.py \
  tests/test_skip_bad_steps.py tests/test_grad.py tests/test_tree_utils.py \
  tests/test_compositions.py tests/test_peer_semantics.py tests/test_long_runs.py \
  tests/test_overflow_guard.py tests/test_guard_outputs.py tests/test_policy.py \
  tests/test_autocast.py optax_lossscale
# On the newest jax and flax (constraints-newest.txt, Python 3.12: jax >= 0.11
# and flax >= 0.12.9 need it): what a new jax release breaks first, autocast
# (it reads jaxprs: the walk over every primitive jax defines, the rules, the
# regions, fp8, the unknown-primitive fallback, custom_vjp), the libraries
# under autocast (Equinox, diffrax, e3nn-jax), the Flax and Equinox
# integrations, and the loss scales and wrappers; about 8 minutes on 2 cores.
NEWEST_TESTS := $(addprefix tests/,test_autocast_primitives.py test_autocast_unknown.py \
  test_autocast.py test_autocast_regions.py test_autocast_ops.py test_fp8_autocast.py \
  test_layout.py test_flax_train_state.py test_flax_nnx.py test_equinox.py test_loss_scale.py \
  test_optimizer.py test_skip_bad_steps.py test_master_weights.py test_autocast_libraries.py \
  test_quantize.py test_state_dtypes.py test_stochastic_rounding.py test_schedule.py \
  test_apply_gradients.py test_compiled_step.py test_docs.py)
TEST_DEPS := pytest pytest-xdist hypothesis jmp chex
# test_equinox.py's example needs scikit-learn (its data set): the module is skipped without it.
NEWEST_DEPS := $(TEST_DEPS) scikit-learn
LOWEST := .venv-lowest
NEWEST := .venv-newest
JAX011 := .venv-jax011
PY312 := .venv-py312
PY313 := .venv-py313

test-compat: test-lowest test-py312 test-py313 test-newest test-jax011

# The lowest declared versions (pyproject.toml's lower bounds, everything else
# pinned by constraints-lowest.txt) on Python 3.11.
test-lowest: $(LOWEST)/.installed-stamp
	$(LOWEST)/bin/python .ci/lower_bounds.py --check flax
	$(LOWEST)/bin/python -m pytest -n 2 --dist loadfile $(LOWEST_IGNORE)

$(LOWEST)/.installed-stamp: pyproject.toml constraints-lowest.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "test-lowest needs Python 3.11"'
	test -x $(LOWEST)/bin/python || $(PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install --quiet -c constraints-lowest.txt -e '.[flax]' $(TEST_DEPS)
	touch $@

# The pinned set (constraints.txt) on Python 3.12 and 3.13, without the flax
# extra (the Flax integration runs on 3.11 at both ends), to keep CI short.
test-py312: $(PY312)/.installed-stamp
	$(PY312)/bin/python -m pytest -n 2 --dist loadfile $(PY_TESTS)

test-py313: $(PY313)/.installed-stamp
	$(PY313)/bin/python -m pytest -n 2 --dist loadfile $(PY_TESTS)

.venv-py3%/.installed-stamp: pyproject.toml constraints.txt
	test -x .venv-py3$*/bin/python || $$(.ci/find-python 3.$*) -m venv .venv-py3$*
	.venv-py3$*/bin/python -m pip install --quiet -c constraints.txt -e . $(TEST_DEPS)
	touch $@

test-newest: $(NEWEST)/.installed-stamp
	$(NEWEST)/bin/python -m pytest -n 2 --dist loadfile $(NEWEST_TESTS)

$(NEWEST)/.installed-stamp: pyproject.toml constraints-newest.txt
	test -x $(NEWEST)/bin/python || $$(.ci/find-python 3.12) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install --quiet -c constraints-newest.txt -e '.[flax,equinox,libraries]' \
	  $(NEWEST_DEPS)
	touch $@

# jax 0.11, the release between the pinned 0.10 and the newest 0.12, with the newest set
# otherwise (constraints-newest.txt but its jax and jaxlib) on Python 3.12: the same test
# files as test-newest.
test-jax011: $(JAX011)/.installed-stamp
	$(JAX011)/bin/python -m pytest -n 2 --dist loadfile $(NEWEST_TESTS)

$(JAX011)/.installed-stamp: pyproject.toml constraints-newest.txt
	test -x $(JAX011)/bin/python || $$(.ci/find-python 3.12) -m venv $(JAX011)
	grep -vE '^jax(lib)?==' constraints-newest.txt > $(JAX011)/constraints.txt
	$(JAX011)/bin/python -m pip install --quiet -c $(JAX011)/constraints.txt jax==0.11.2 \
	  jaxlib==0.11.2 -e '.[flax,equinox,libraries]' $(NEWEST_DEPS)
	touch $@

# Regenerates constraints-newest.txt (after a jax or flax release): a fresh
# Python 3.12 environment holding the newest releases pip resolves today, frozen.
constraints-newest:
	rm -rf .venv-freeze
	$$(.ci/find-python 3.12) -m venv .venv-freeze
	.venv-freeze/bin/python -m pip install --quiet -e '.[flax,equinox,libraries]' $(NEWEST_DEPS)
	{ echo '# The newest releases pip resolved on Python 3.12: `make constraints-newest`.'; \
	  .venv-freeze/bin/python -m pip freeze --exclude-editable; } > constraints-newest.txt
	rm -rf .venv-freeze

# Regenerates constraints-lowest.txt after a lower bound in pyproject.toml
# changes: a fresh environment holding exactly the lower bounds, and whatever
# else pip resolves today, frozen.
constraints-lowest:
	rm -rf .venv-freeze
	$(PYTHON) -m venv .venv-freeze
	.venv-freeze/bin/python -m pip install --quiet $$($(PYTHON) .ci/lower_bounds.py flax) \
	  -e '.[flax]' $(TEST_DEPS)
	.venv-freeze/bin/python .ci/lower_bounds.py --check flax
	{ echo '# The lowest declared versions and what pip resolved with them: `make constraints-lowest`.'; \
	  .venv-freeze/bin/python -m pip freeze --exclude-editable; } > constraints-lowest.txt
	rm -rf .venv-freeze

clean:
	rm -rf $(VENV) $(LOWEST) $(NEWEST) $(JAX011) $(PY312) $(PY313) $(DIST_VENV) build dist *.egg-info docs/_build
