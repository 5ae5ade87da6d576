# The two commands of the README: `make demo` and `make test` (each sets itself up first).
PYTHON ?= python3
VENV := .venv
BIN := $(abspath $(VENV))/bin
INSTALLED := $(VENV)/.installed
RUN := PATH="$(BIN):$$PATH"

.PHONY: setup demo test lint

$(INSTALLED): requirements.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-test.txt
	touch $@

setup: $(INSTALLED)

demo: $(INSTALLED)
	$(RUN) snakemake all --profile profiles/local --configfile sample/config.yaml
	$(RUN) snakemake all --configfile sample/config.yaml --report report.html
	$(RUN) python -m workflow.report.summary --print results/summary.csv

test: $(INSTALLED)
	$(RUN) python -m pytest -q -n 2 --dist load --durations=25 tests

lint: $(INSTALLED)
	$(RUN) snakemake --lint
