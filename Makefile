# `make serve` and `make test` each bootstrap .venv from nothing and are idempotent.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# MLX's Linux CPU wheel links a slow reference BLAS; OpenBLAS is ~50x faster for fp32 matmuls.
OPENBLAS := /usr/lib/x86_64-linux-gnu/libopenblas.so.0
PRELOAD = LD_PRELOAD=$$([ -f $(OPENBLAS) ] && echo $(OPENBLAS))
# Debian's Chromium: the playground's browser tests drive it with playwright.
CHROMIUM := /usr/bin/chromium
# Test processes (pytest-xdist), one test file each at a time: module-scoped servers start once.
TEST_WORKERS ?= 2

.PHONY: install serve test lint bench-smoke openblas chromium clean

install: $(STAMP) openblas

# Ctrl-C at a terminal interrupts make with the server, whatever the server's exit status. So
# there `set -m` runs the server as a job of its own in the terminal's foreground: Ctrl-C reaches
# it alone, it drains and exits 0, and make with it. Elsewhere (a service, CI, `make serve &`)
# the recipe's shell becomes the server, so the signals make gets (and forwards) reach it.
SERVE := $(PY) -m server --config config.yaml
FOREGROUND := [ -t 0 ] && [ "$$(ps -o tpgid= -p $$$$)" -eq "$$(ps -o pgid= -p $$$$)" ]

serve: SHELL := /bin/bash
serve: $(STAMP) openblas
	@echo "$(SERVE)"
	@if $(FOREGROUND) 2>/dev/null; then set -m; $(PRELOAD) $(SERVE); status=$$?; exit $$status; \
	else $(PRELOAD) exec $(SERVE); fi

test: $(STAMP) openblas chromium
	$(PRELOAD) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check server api_schemas tests scripts
	$(VENV)/bin/lint-imports

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found; set PYTHON=python3.x"; exit 1; }
	[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# Best effort: install Debian's OpenBLAS when we can (root, Linux, apt); harmless elsewhere.
openblas:
	@if [ "$$(uname -s)" = Linux ] && [ ! -f $(OPENBLAS) ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1)) || \
		echo "OpenBLAS not installed; MLX will use its slower built-in BLAS"; \
	fi

# Best effort, as for OpenBLAS: the browser tests of the playground page (GET /) need Chromium;
# playwright's own browser download is not used. Without it they skip, except with CI=true.
chromium:
	@if [ "$$(uname -s)" = Linux ] && [ ! -x $(CHROMIUM) ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null 2>&1 && \
		  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1)) || \
		echo "Chromium not installed; the playground's browser tests will skip (CI: fail)"; \
	fi

clean:
	rm -rf $(VENV) models/generated
