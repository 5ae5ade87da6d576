# The two commands of the README: `make demo` and `make test` (each sets itself up first).
PYTHON ?= python3
VENV := .venv
BIN := $(abspath $(VENV))/bin
INSTALLED := $(VENV)/.installed
RUN := PATH="$(BIN):$$PATH"
PYPY ?= pypy3
PYPY_VENV := .venv-pypy

.PHONY: setup pypy-venv demo test lint run-dir

# The pins (Snakemake 9, numpy 2.4, pandas 3, ...) need Python >= 3.11; the suite passes on 3.11, 3.12 and 3.13.
PYTHON_FLOOR := 3.11
$(INSTALLED): requirements.txt requirements-test.txt
	@$(PYTHON) -c 'import sys; floor = "$(PYTHON_FLOOR)"; \
	  need = f"snakebert needs Python >= {floor} (its pins Snakemake 9, numpy and pandas do)"; \
	  sys.exit(None if sys.version_info >= tuple(map(int, floor.split("."))) else \
	  f"error: {need}; $(PYTHON) is {sys.version.split()[0]}: pick another, e.g. make PYTHON=python3.12")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-test.txt
	touch $@

# The extract rule runs on PyPy (envs/extract.yaml): where `pypy3` is installed (Debian: pypy3 pypy3-venv), a venv
# with wikiextractor for the tests that compare it with CPython and its benchmark; elsewhere they are skipped.
pypy-venv:
	@if command -v $(PYPY) >/dev/null 2>&1 && [ ! $(PYPY_VENV)/.installed -nt requirements.txt ]; then \
	  $(PYPY) -m venv $(PYPY_VENV) && \
	  $(PYPY_VENV)/bin/pip install --quiet $$(grep '^wikiextractor==' requirements.txt) && \
	  touch $(PYPY_VENV)/.installed || echo "no PyPy venv ($(PYPY) -m venv failed): the PyPy tests will be skipped"; \
	fi

setup: $(INSTALLED) pypy-venv

# The demo runs in its own directory, demo/ (data, runs, results, logs, report.html), never in the real run's; the
# sample's paths in sample/config.yaml are relative to the run directory, hence the link.
DEMO := demo

demo: $(INSTALLED)
	mkdir -p $(DEMO) && ln -sfn ../sample $(DEMO)/sample
	$(RUN) snakemake all --directory $(DEMO) --profile profiles/local --configfile sample/config.yaml
	$(RUN) snakemake all --directory $(DEMO) --configfile sample/config.yaml --report report.html
	$(RUN) python -m workflow.report.summary --print $(DEMO)/results/summary.csv --report $(DEMO)/report.html

# A run directory apart from the clone, where the guide's commands run as written (`make run-dir
# RUN=/scratch/$$USER/run1`): a Snakefile that includes the clone's, a copy of config.yaml (kept if there), and
# links to the clone's profiles/ (so `--profile profiles/NAME` resolves) and workflow/ (so `python -m workflow...` does).
run-dir:
	@case "$(RUN)" in /*) ;; *) echo "error: make run-dir needs RUN=/absolute/path (the run directory)" >&2; exit 2;; esac
	mkdir -p $(RUN)
	printf 'include: "%s/Snakefile"\n' "$(CURDIR)" > $(RUN)/Snakefile
	[ -e $(RUN)/config.yaml ] || cp config.yaml $(RUN)/config.yaml
	[ -e $(RUN)/profiles ] || ln -s $(CURDIR)/profiles $(RUN)/profiles
	[ -e $(RUN)/workflow ] || ln -s $(CURDIR)/workflow $(RUN)/workflow

test: $(INSTALLED) pypy-venv
	$(RUN) python -m pytest -q -n 2 --dist load --durations=25 tests

lint: $(INSTALLED)
	$(RUN) snakemake --lint
