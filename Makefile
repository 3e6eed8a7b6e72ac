# Two commands set up a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test docs bench bench-quick install clean lint

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,examples]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -n 2 -m "not slow"

# The site (mkdocs.yml, docs/) into site/; the docs extra comes with the test extra.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

bench-quick: $(STAMP)
	$(PY) -m benchmarks.run --quick --json benchmarks/results/quick.json --markdown BENCHMARKS.md

bench: $(STAMP)
	$(PY) -m benchmarks.run --json benchmarks/results/full.json

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache site

lint: $(STAMP)
	$(PY) -m pip install --quiet "ruff>=0.6"
	$(PY) -m ruff check eqxpar tests examples benchmarks
	$(PY) -m ruff format --check eqxpar tests examples benchmarks
