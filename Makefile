# vrtspike: every target does its own set-up on a fresh machine, idempotently.
#   make demo   the main job: 2 CPU ranks train unet_spike on a synthetic set (made if absent), then its plot
#   make cache-demo  a cache server driven by a short synthetic load, then its stats
#   make test   formatting, lints, the docs check, then every unit and multi-process test (with real one- and three-node SLURMs)
#   make check-docs  every link, path, make target and vrtspike command the docs name exists
#   make test-slurm  only the sbatch template under real one- and three-node SLURMs (~3 min; root)
#   make bench  benchmarks: the cache as JSON, the store's eviction at a node's scale, the loader against the peer, then the model's time and memory
#   make bench-model  the VRT GoPro model's time and peak RSS (checkpointing off/on) beside PyTorch's
#   make bench-spike  the spike study: tiny VRT-Spike trained with spikes on and off, one table
#   make bench-link  gradient averaging (after backward, the Reducer, the Reducer in bf16) on a 100 Mbit/s link and loopback
#   make bench-python  the PyTorch peer's loader shape with its own Dataset and with the vrtspike package's (Pss, samples/s, leftover shm)
#   make bench-policy  the cache's eviction policies (LRU, planned, Belady's offline bound) at 5-50% caps, 1 and 4 ranks
#   make bench-throttled  the loader's stall on a read-throttled loop device: LRU, planned, planned + prefetch (root)
#   make build  release binaries in target/release (NCCL=0: a Gloo-only c10d shim, on purpose), then the Python package into .venv
#   make wheel  the `vrtspike` Python package's wheel in target/wheels (for other venvs; docs/pytorch.md)
#   make test-python  the Python package's pytest suite (crates/py/tests)
#   make test-gpu  the GPU test suite (needs a CUDA device; fails without one)
#   make gpu-bundle  one folder under 64 MiB that runs on a GPU host with its own torch
#   make gpu-bundle-check  proves that folder self-sufficient here (root; venv hidden)
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
ROOT := $(abspath $(dir $(lastword $(MAKEFILE_LIST))))
VENV := $(ROOT)/.venv
STAMPS := $(ROOT)/.stamps
PYTHON ?= python3
TORCH_VERSION := 2.11.0
APT_PACKAGES := libgloo-dev libhdf5-dev pkg-config g++ fonts-dejavu-core iproute2
# The real SLURMs of launcher/tests/launch_slurm_real.rs (one node) and
# launch_slurm_multinode.rs (three nodes in namespaces; util-linux's unshare and nsenter
# and iproute2's ip too): slurmctld, slurmd, the client commands and munged (the tests
# start and stop them themselves).
SLURM_APT_PACKAGES := slurm-wlm munge

# tch 0.24 binds libtorch 2.11.0 from the venv's torch wheel (torch-sys runs the
# venv's `python` when VIRTUAL_ENV is set); build.rs sets the run-time rpath.
export VIRTUAL_ENV := $(VENV)
export PATH := $(VENV)/bin:$(HOME)/.cargo/bin:$(PATH)
export LIBTORCH_USE_PYTORCH := 1
export CARGO_TERM_COLOR := never

BIN := $(ROOT)/target/release/vrtspike
LAUNCH := $(ROOT)/target/release/vrtspike-launch

.PHONY: setup build wheel python-package test-python bench-python test lint demo cache-demo bench bench-model bench-spike bench-link bench-policy \
	bench-throttled clean \
	test-gpu gpu-bundle gpu-bundle-check check-docs test-slurm

setup: $(STAMPS)/apt $(STAMPS)/venv

$(STAMPS)/apt:
	@mkdir -p $(STAMPS)
	@if ! dpkg -s $(APT_PACKAGES) >/dev/null 2>&1; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] && echo "" || echo sudo ); \
	  echo "installing Debian packages: $(APT_PACKAGES)"; \
	  $$SUDO apt-get update -qq; \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $(APT_PACKAGES) >/dev/null; \
	fi
	@touch $@

$(STAMPS)/apt-slurm:
	@mkdir -p $(STAMPS)
	@if ! dpkg -s $(SLURM_APT_PACKAGES) >/dev/null 2>&1; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] && echo "" || echo sudo ); \
	  echo "installing Debian packages: $(SLURM_APT_PACKAGES)"; \
	  $$SUDO apt-get update -qq; \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $(SLURM_APT_PACKAGES) >/dev/null; \
	fi
	@touch $@

$(STAMPS)/venv: requirements.txt
	@mkdir -p $(STAMPS)
	@[ -x $(VENV)/bin/python ] || $(PYTHON) -m venv $(VENV)
	@if ! $(VENV)/bin/python -c "import torch,sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_VERSION)')" 2>/dev/null \
	    || ! $(VENV)/bin/python -c "import numpy, PIL, tensorboard" 2>/dev/null \
	    || ! $(VENV)/bin/python -c "$$CUDA_HEADERS_CHECK" 2>/dev/null; then \
	  echo "installing torch==$(TORCH_VERSION), the CUDA/NCCL headers, tensorboard and the baseline's packages into $(VENV)"; \
	  $(VENV)/bin/pip install -q --disable-pip-version-check -r requirements.txt; \
	fi
	@if ! $(VENV)/bin/python -c "import maturin, pytest" 2>/dev/null; then \
	  echo "installing maturin and pytest (the Python package's build and tests) into $(VENV)"; \
	  $(VENV)/bin/pip install -q --disable-pip-version-check -r requirements.txt; \
	fi
	@touch $@

# The c10d shim compiles NCCL against these headers (requirements.txt installs them).
define CUDA_HEADERS_CHECK
import os, sys, torch
site = os.path.dirname(os.path.dirname(torch.__file__))
need = ["nvidia/cu13/include/cuda_runtime.h", "nvidia/cu13/include/crt/host_config.h",
        "nvidia/cu13/include/cccl/cuda/std/cstdint", "nvidia/nccl/include/nccl.h"]
sys.exit(any(not os.path.isfile(os.path.join(site, p)) for p in need))
endef
export CUDA_HEADERS_CHECK

# NCCL=0 builds the c10d shim without NCCL on purpose (the build says so).
NCCL ?= 1
ifeq ($(NCCL),0)
export VRTSPIKE_NO_NCCL := 1
endif

build: setup
	cargo build --release --workspace
	$(MAKE) --no-print-directory python-package PY_PROFILE=release

# The `vrtspike` Python package (crates/py, docs/pytorch.md): the extension module
# vrtspike._native (built on vrtspike-data alone: no libtorch) and the
# vrtspike-cache server it starts, shipped in the wheel (vrtspike/_bin/), built by
# maturin from the same sources and installed into the venv. The wheel links the
# system's libhdf5 (no auditwheel repair: it is for machines set up like this one).
PY_PROFILE ?= release
PY_CRATE := $(ROOT)/crates/py
WHEELS := $(ROOT)/target/wheels
PY_BIN_DIR := $(if $(filter release,$(PY_PROFILE)),release,debug)

wheel: setup
	cargo build $(if $(filter release,$(PY_PROFILE)),--release,) -p vrtspike-data --bin vrtspike-cache
	@mkdir -p $(PY_CRATE)/python/vrtspike/_bin $(WHEELS)
	cp $(ROOT)/target/$(PY_BIN_DIR)/vrtspike-cache $(PY_CRATE)/python/vrtspike/_bin/vrtspike-cache
	rm -f $(WHEELS)/vrtspike-*.whl
	maturin build --quiet -m $(PY_CRATE)/Cargo.toml --profile $(PY_PROFILE) --auditwheel skip \
	  $(if $(filter release,$(PY_PROFILE)),--strip,) -o $(WHEELS)
	@ls $(WHEELS)/vrtspike-*.whl

python-package: wheel
	$(VENV)/bin/pip install -q --disable-pip-version-check --force-reinstall --no-deps $(WHEELS)/vrtspike-*.whl
	cd / && $(VENV)/bin/python -c 'import vrtspike; print("vrtspike", vrtspike.BUILD_ID, "in", vrtspike.__file__)'

# The Python package's tests (crates/py/tests), on a dev build of the package and
# of `vrtspike` (its `synth` makes their data, its `bench loader` the samples they
# must equal).
test-python: setup
	$(MAKE) --no-print-directory python-package PY_PROFILE=dev
	cargo build -p vrtspike --bin vrtspike
	cd $(PY_CRATE) && VRTSPIKE_TEST_BIN=$(ROOT)/target/debug/vrtspike \
	  $(VENV)/bin/python -m pytest -q tests

# ... and what runs without libtorch stays so: vrtspike-data (the crate of the
# vrtspike-cache binary) has no tch or torch-sys among its dependencies.
lint: setup
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --test gpu -- -D warnings
	@deps=$$(cargo tree -p vrtspike-data -e normal,build --prefix none); \
	if grep -E '^(tch|torch-sys) ' <<< "$$deps"; then \
	  echo "vrtspike-data (vrtspike-cache) depends on libtorch (above): it must build without it"; exit 1; \
	fi

# The binaries first: tests/cache_binary.rs needs vrtspike-data's vrtspike-cache,
# which `cargo test` builds only for a package with integration tests of its own.
test: setup lint check-docs $(STAMPS)/apt-slurm
	cargo build --workspace --bins
	cargo test --workspace
	$(MAKE) --no-print-directory test-python

# README.md and docs/: every relative link and anchor, repository path, make target,
# vrtspike / vrtspike-launch subcommand and flag they name exists (read from the
# sources, so no build is needed); then the checker's own tests.
check-docs:
	$(PYTHON) $(ROOT)/scripts/check_docs.py
	$(PYTHON) $(ROOT)/scripts/test_check_docs.py

# The sbatch template under a real one-node SLURM (launcher/tests/launch_slurm_real.rs)
# and with --nodes=2 under a real three-node one (launch_slurm_multinode.rs), with their
# figures: signal to exit, requeue to resume. Needs root (slurmd, namespaces).
test-slurm: setup $(STAMPS)/apt-slurm
	cargo build --workspace --bins
	cargo test -p vrtspike-launch --test launch_slurm_real -- --nocapture
	cargo test -p vrtspike-launch --test launch_slurm_multinode -- --nocapture

DEMO_DATA := $(ROOT)/data/demo
DEMO_CONFIG := configs/demo/unet_spike_demo.yaml

demo: build
	@cd $(ROOT) && [ -f $(DEMO_DATA)/dataset.yaml ] || $(BIN) synth --out $(DEMO_DATA) --seqs 12 --test-seqs 4 --frames 12
	cd $(ROOT) && run=runs/demo-$$(date -u +%Y%m%d-%H%M%S) \
	  && $(LAUNCH) --gpus 0 --ranks 2 --config $(DEMO_CONFIG) --run-dir $$run \
	  && $(BIN) plot $$run

cache-demo: build
	$(BIN) demo

# Side-by-side loader benchmark (issue 3, section 5): vrtspike's loader and the
# PyTorch peer on the same 720x1280 synthetic data, same ranks, workers, clip,
# crop and epochs, each under pss-tree; PEER_CACHE_GB is the peer's per-worker LRU.
BENCH_DATA := $(ROOT)/data/bench-gopro
BENCH_OUT := $(ROOT)/bench-out
BENCH_ARGS := --ranks 2 --workers 2 --clip 6 --crop 256 --epochs 2
PEER_CACHE_GB ?= 2.0
# The cache server's default cap (2 GiB); its pages are reserved only as records
# arrive, so the job's Pss follows the data (24 frames x 8.1 MB = 194 MB), not the cap.
LOADER_CACHE_GB ?= 2.0
PSS_TREE := $(ROOT)/../shared/tools/pss-tree
PEER := $(ROOT)/../shared/baselines/torch_loader.py

bench: build
	$(BIN) bench cache --json
	$(BIN) bench store
	$(BIN) bench sign
	@test -f $(BENCH_DATA)/dataset.yaml || \
	  $(BIN) synth --gopro --seqs 2 --test-seqs 0 --frames 12 --out $(BENCH_DATA)
	@mkdir -p $(BENCH_OUT)
	$(PSS_TREE) --json $(BENCH_OUT)/vrtspike-pss.json -- \
	  $(BIN) bench loader --json --root $(BENCH_DATA) $(BENCH_ARGS) \
	  --cache-gb $(LOADER_CACHE_GB) > $(BENCH_OUT)/vrtspike.out
	$(PSS_TREE) --json $(BENCH_OUT)/peer-pss.json -- \
	  $(VENV)/bin/python $(PEER) --root $(BENCH_DATA) $(BENCH_ARGS) \
	  --cache-gb $(PEER_CACHE_GB) > $(BENCH_OUT)/peer.out
	$(VENV)/bin/python $(ROOT)/scripts/bench_table.py $(BENCH_OUT)
	$(MAKE) --no-print-directory bench-policy
	$(MAKE) --no-print-directory bench-model
	$(MAKE) --no-print-directory bench-link

# The loader shape of the PyTorch peer (issue 38): ../shared/baselines/torch_loader.py
# (2 rank processes x 2 DataLoader workers, clip 6, crop 256, 720x1280 synthetic
# frames, 2 epochs) with its own Dataset (a per-worker LRU of float32 frames) and the
# same shape with the vrtspike package's Dataset (scripts/bench_python_loader.py: one
# node-shared cache server, planned policy), each under pss-tree; then the table.
bench-python: build
	@test -f $(BENCH_DATA)/dataset.yaml || \
	  $(BIN) synth --gopro --seqs 2 --test-seqs 0 --frames 12 --out $(BENCH_DATA)
	@mkdir -p $(BENCH_OUT)/python
	$(PSS_TREE) --json $(BENCH_OUT)/python/vrtspike-pss.json -- \
	  $(VENV)/bin/python $(ROOT)/scripts/bench_python_loader.py --root $(BENCH_DATA) $(BENCH_ARGS) \
	  --cache-gb $(LOADER_CACHE_GB) > $(BENCH_OUT)/python/vrtspike.out
	$(PSS_TREE) --json $(BENCH_OUT)/python/peer-pss.json -- \
	  $(VENV)/bin/python $(PEER) --root $(BENCH_DATA) $(BENCH_ARGS) \
	  --cache-gb $(PEER_CACHE_GB) > $(BENCH_OUT)/python/peer.out
	$(VENV)/bin/python $(ROOT)/scripts/bench_table.py $(BENCH_OUT)/python "vrtspike.data.Dataset"

# The cache's eviction policies (issue 28 §2): one recorded access stream (the ranks'
# shuffled clips of 6 frames, 3 epochs, the last two counted) read by the loader under
# LRU and under the planned policy (ranks in lockstep, no prefetch), beside Belady's
# offline bound computed from the stream, at caps of 5, 10, 25 and 50% of the compact
# size, with 1 and 4 ranks. The set has GoPro's shape (22 sequences of 100 frames) at
# 64x96, so the 16 runs take a few minutes.
POLICY_DATA := $(ROOT)/data/bench-policy-gopro

bench-policy: build
	@test -f $(POLICY_DATA)/dataset.yaml || \
	  $(BIN) synth --seqs 22 --test-seqs 0 --frames 100 --height 64 --width 96 --blur-frames 7 --out $(POLICY_DATA)
	@mkdir -p $(BENCH_OUT)
	$(BIN) bench loader --policy-table --root $(POLICY_DATA) --workers 2 --clip 6 --crop 32 \
	  --bins 8 --epochs 3 | tee $(BENCH_OUT)/policy-table.md

# The loader on a slow store (issue 28 §3): the data on a loop device whose reads a
# cgroup throttles to 200 MB/s, the demo's loader and step time, the cache at 25%
# (root; see scripts/throttled_store.sh for the settings).
bench-throttled: build
	bash $(ROOT)/scripts/throttled_store.sh $(BENCH_OUT)/throttled

# Model memory (issue 10): `vrtspike profile --json` of the VRT GoPro config at 6x64x64,
# forward + backward, 2 threads: the heap before issue 10, then checkpointing off and
# on, each with its peak RSS, beside the reference VRT's PyTorch figures (~5 min).
bench-model: build
	@mkdir -p $(BENCH_OUT)
	cd $(ROOT) && $(VENV)/bin/python scripts/model_memory.py --bin $(BIN) \
	  --out $(BENCH_OUT)/model-memory.json

# Gradient averaging on a slow link (issue 22): the tiny VRT-Spike on 2 CPU ranks with
# Gloo, flat buckets after backward vs the Reducer vs the Reducer in bf16, same seed; two
# network namespaces joined by a veth shaped to 100 Mbit/s (root; else loopback only),
# then loopback; step time and the communication backward did not hide (~10 min).
bench-link: build
	@cd $(ROOT) && [ -f $(DEMO_DATA)/dataset.yaml ] || $(BIN) synth --out $(DEMO_DATA) --seqs 12 --test-seqs 4 --frames 12
	cd $(ROOT) && $(VENV)/bin/python scripts/slow_link_bench.py --launch $(LAUNCH) --out $(BENCH_OUT)/link

# Spike study (issue 10): the tiny VRT-Spike trained on the demo set twice by 2 CPU
# ranks, MODEL.SPIKE.ENABLED true and false (same seed, data and steps), then a table
# of validation PSNR/SSIM, the blurred input's PSNR and the spikes' margin.
SPIKE_STUDY_CONFIG := configs/study/vrt_spike_study.yaml

bench-spike: build
	@cd $(ROOT) && [ -f $(DEMO_DATA)/dataset.yaml ] || $(BIN) synth --out $(DEMO_DATA) --seqs 12 --test-seqs 4 --frames 12
	cd $(ROOT) && $(VENV)/bin/python scripts/spike_study.py --launch $(LAUNCH) \
	  --config $(SPIKE_STUDY_CONFIG) --out runs/spike-study-$$(date -u +%Y%m%d-%H%M%S)

# The GPU suite (tests/gpu, `test = false`: not in `make test`): on a machine without
# a CUDA device every test fails, by design.
test-gpu: setup
	cargo test --release --test gpu -- --test-threads 1

# The GPU-host bundle: stripped binaries, the GPU suite's binary, the libraries the
# host lacks, configs, run-on-gpu.sh and scripts/gpu_run.sh; VRT_REF (a checkout or
# git directory of the public JingyunLiang/VRT) adds the PyTorch reference's models/.
GPU_BUNDLE := $(ROOT)/gpu-bundle
VRT_REF ?=

gpu-bundle: build
	@gpu_tests=$$(cargo test --release --test gpu --no-run --message-format=json \
	  | $(VENV)/bin/python -c 'import json, sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu"][-1])') \
	  && bash $(ROOT)/scripts/gpu_bundle.sh $(GPU_BUNDLE) "$$gpu_tests" $(VRT_REF)

gpu-bundle-check: gpu-bundle
	bash $(ROOT)/scripts/gpu_bundle_check.sh $(GPU_BUNDLE) $(VENV)

clean:
	cargo clean
