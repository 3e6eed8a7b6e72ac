# Two commands set up a fresh machine: `make demo` and `make test`.
# `make test PYTHON=python3.12` does the same in a venv of that Python's own
# (.venv-python3.12), which gets the newest JAX that Python allows.
PYTHON ?= python3
VENV ?= $(if $(filter python3,$(PYTHON)),.venv,.venv-$(notdir $(PYTHON)))
PY := $(VENV)/bin/python
# A pyenv shim answers "command not found" for a Python that is installed but not
# the active version; then ask pyenv for that version's interpreter.
PYTHON_BIN := $(shell $(PYTHON) -c 'import sys; print(sys.executable)' 2>/dev/null || \
	PYENV_VERSION=$$(pyenv versions --bare 2>/dev/null | grep -x '$(patsubst python%,%,$(notdir $(PYTHON)))[.0-9]*' | tail -1) \
	$(PYTHON) -c 'import sys; print(sys.executable)' 2>/dev/null)
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test test-slow test-newest docs bench bench-quick install clean lint release-check

$(STAMP): pyproject.toml
	@test -n "$(PYTHON_BIN)" || { echo "make: no Python found for PYTHON=$(PYTHON); install it or pass PYTHON=/path/to/python" >&2; exit 1; }
	test -x $(PY) || $(PYTHON_BIN) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,examples]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Two workers, one per core of the smallest machine we test on; worksteal lets an idle
# worker take the other's queued cases, so a long case late in the run leaves no core idle.
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist worksteal -m "not slow" $(TESTS)

# The cases kept out of `make test` for time (marked slow): the deep plan fuzz, the
# random-fault restart trials, the preemption runs, the costliest compile checks and
# the other sizes and options of each code path (tests/_slow_cases.py).
test-slow: $(STAMP)
	$(PY) -m pytest -n 2 --dist worksteal -m slow $(TESTS)

# What CI runs on the other end of the supported range (see .ci/run): each strategy's
# parity tests, the collective-byte tests, x64, README and docs, every file with cases
# skipped at the oldest end (test_skip_nonfinite: jaxlib >= 0.12's steps) and the
# combinations that used to abort XLA (test_silent_wrongs); of their slow cases, those
# marked `newest` (tests/_slow_cases.py: parity on paths whose other cases are all
# slow, such as x64 pipelines and the V schedules at pipe 4).
NEWEST_TESTS := tests/test_data_parallel.py tests/test_fsdp.py tests/test_tp_step.py \
	tests/test_pipeline.py tests/test_models.py tests/test_expert_parallel.py \
	tests/test_context_parallel.py tests/test_hlo.py tests/test_nn_comm.py \
	tests/test_accumulate_comm.py tests/test_docs.py tests/test_x64.py \
	tests/test_skip_nonfinite.py tests/test_silent_wrongs.py tests/test_topology.py \
	tests/test_aot.py tests/test_compile_from_shapes.py tests/test_embedding_lookup.py \
	tests/test_overlap.py
test-newest: $(STAMP)
	$(PY) -m pytest -n 2 --dist worksteal -m "not slow or newest" $(NEWEST_TESTS)

# The site (mkdocs.yml, docs/) into site/; the docs extra comes with the test extra.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

bench-quick: $(STAMP)
	$(PY) -m benchmarks.run --quick --json benchmarks/results/quick.json --markdown BENCHMARKS.md

bench: $(STAMP)
	$(PY) -m benchmarks.run --json benchmarks/results/full.json

# Builds the sdist and wheel into dist/, then installs the wheel into a fresh venv
# and runs README's quick start with it.
release-check: $(STAMP)
	$(PY) .ci/release_check.py

clean:
	rm -rf .venv .venv-* build dist *.egg-info .pytest_cache site

lint: $(STAMP)
	$(PY) -m pip install --quiet "ruff>=0.6"
	$(PY) -m ruff check eqxpar tests examples benchmarks
	$(PY) -m ruff format --check eqxpar tests examples benchmarks
