# Two commands that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU wheel: an unpinned torch would pull a multi-GB CUDA build. Override for GPU hosts.
TORCH_SPEC ?= torch==2.13.0
DEMO_DIR ?= demo_run
# Test files run on this many workers (pytest-xdist, a file's tests on one worker): the suite's jobs spend much of
# their time starting processes and waiting on each other, so two workers fill two cores (performance log 25).
TEST_JOBS ?= 2
PYTEST = $(BIN)/python -m pytest -q -rs -n $(TEST_JOBS) --dist loadfile

.PHONY: setup setup-runtime demo test test-all test-fast fixtures nvme-tools bench bench-quick fuzz clean

# Where pip is set to find wheels (the CPU torch wheel, on these machines): uv, which reads no pip config, is told.
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# uv installs what pip would, faster (docs/dev/performance-log.md 24), compiled to .pyc as pip does (where
# PYTHONDONTWRITEBYTECODE is set nothing else compiles them); pip where uv cannot be had.
# `make demo` installs the runtime only (torch, DeepSpeed, safetensors); `make test` adds the test toolchain and,
# beside it, Azurite, Azure's storage emulator, for the az:// test (which skips, saying so, where there is no npm).
INSTALL = { $(BIN)/pip install -q uv && $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python \
	    $(addprefix --find-links ,$(FIND_LINKS)) -e $(1) "$(TORCH_SPEC)" \
	  || $(BIN)/pip install -q -e $(1) "$(TORCH_SPEC)"; }

$(VENV)/.runtime: $(BIN)/python pyproject.toml
	$(call INSTALL,".[runtime]")
	touch $@

$(VENV)/.installed: $(VENV)/.runtime
	{ command -v npm >/dev/null && npm install -s --no-audit --no-fund --prefix .tools azurite@3 >/dev/null 2>&1; } & \
	$(call INSTALL,".[test]") && { wait || true; }
	touch $@

# The tree's own modules compiled to .pyc: where PYTHONDONTWRITEBYTECODE is set (these machines) every process the
# tests start would compile them again (performance log 25); compileall skips what is up to date.  Not the
# benchmark checkpoints' DeepSpeed scripts: a `__pycache__` there would travel with them as a companion.
setup: $(VENV)/.installed
	@$(BIN)/python -m compileall -q -j 0 -x 'bench/cache/' dsckpt tests fixtures bench > /dev/null

setup-runtime: $(VENV)/.runtime
	@$(BIN)/python -m compileall -q -j 0 dsckpt > /dev/null

# The README's examples, in $(DEMO_DIR)/ (they run there as written afterwards: `cd demo_run`; tested).
DS = cd $(DEMO_DIR) && $(abspath $(BIN))/dsckpt
demo: setup-runtime
	rm -rf $(DEMO_DIR) && mkdir -p $(DEMO_DIR)
	$(DS) train --stage 3 --nproc 2 --steps 30 --save-dir runs/demo
	$(DS) inspect runs/demo
	$(DS) consolidate runs/demo model.safetensors --verify
	$(DS) diff runs/demo model.safetensors
	$(DS) check-finite runs/demo --optimizer
	$(DS) resume --full-weights model.safetensors --stage 3 --nproc 2 --check
	$(DS) resume --full-weights model.safetensors --stage 3 --nproc 2 --steps 10 --save-dir runs/demo
	$(DS) reshard runs/demo runs/demo_ws3 --world-size 3
	$(DS) resume runs/demo_ws3 --nproc 3 --steps 5
	$(DS) convert runs/demo runs/demo_dcp --to dcp
	$(DS) convert runs/demo runs/demo_universal --to universal
	$(DS) convert runs/demo_dcp runs/demo_back --to deepspeed -w 3 --stage 3 --model dsckpt.runtime.demo_model:build_demo_model
	$(DS) verify runs/demo --all-tags
	$(DS) list runs/demo
	$(DS) inspect runs/demo

# The type checker first (pyproject.toml's [tool.mypy]: the whole package; api/, formats/, plan/ strictly; ~8 s).
MYPY = $(BIN)/python -m mypy

test: setup
	$(MYPY)
	$(PYTEST)

# Everything, the slow cases too (the whole HF Trainer / Accelerate matrix, DeepSpeed's Muon and its JIT build,
# the ZeRO-Infinity training flows once nvme-tools could build the async_io op, ZenFlow and its JIT-built CPU Adam).
test-all: setup nvme-tools
	$(MYPY)
	$(PYTEST) -m "slow or not slow"

# The edit loop: every test that starts no DeepSpeed ranks (layers, formats, plans, hostile input, CLI contract).
test-fast: setup
	$(MYPY)
	$(PYTEST) -m "not slow and not runtime"

fixtures: setup
	$(BIN)/python fixtures/make_fixtures.py

# DeepSpeed's async_io op (ZeRO-Infinity's NVMe offload) needs libaio: Debian's packages unpacked, no root needed
# (tests/nvme_support.py), then its JIT build (~5 min on 2 cores), cached in .tools/torch_extensions.  Where apt-get
# cannot fetch them, the NVMe training flows skip and say so.
LIBAIO_DEBS = .tools/libaio-debs
nvme-tools: setup
	@test -f .tools/libaio/usr/include/libaio.h || { mkdir -p $(LIBAIO_DEBS) && cd $(LIBAIO_DEBS) \
	  && { apt-get download libaio-dev libaio1 2>/dev/null || apt-get download libaio-dev libaio1t64; } \
	  && for deb in *.deb; do dpkg -x $$deb ../libaio; done; } || echo "nvme-tools: libaio could not be fetched"
	-$(BIN)/python tests/nvme_support.py

bench: setup
	$(BIN)/pip install -q huggingface_hub  # zero_to_fp32 --safe_serialization needs it
	$(BIN)/python bench/bench_consolidate.py
	$(BIN)/python bench/bench_reshard.py

# A regression guard in about two minutes (the first run also generates four cached checkpoints); CI does not run it.
bench-quick: setup
	$(BIN)/python bench/bench_quick.py
	$(BIN)/python bench/bench_s3.py --layers 2 --runs 3  # object storage, streamed: against moto's server

fuzz: setup
	$(BIN)/pip install -q atheris
	$(BIN)/python fuzz/fuzz_reader.py -max_total_time=120 -print_final_stats=1 fuzz/corpus
	HYPOTHESIS_PROFILE=long $(BIN)/python -m pytest -q tests/test_fuzz_readers.py  # 20,000 examples per property

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache .tools
