# vrtspike: every target does its own set-up on a fresh machine, idempotently.
#   make demo   the main job: 2 CPU ranks train unet_spike on a synthetic set (made if absent)
#   make cache-demo  a cache server driven by a short synthetic load, then its stats
#   make test   formatting, lints, then every unit and multi-process test
#   make bench  benchmarks, printed as JSON
#   make build  release binaries in target/release
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
ROOT := $(abspath $(dir $(lastword $(MAKEFILE_LIST))))
VENV := $(ROOT)/.venv
STAMPS := $(ROOT)/.stamps
PYTHON ?= python3
TORCH_VERSION := 2.11.0
APT_PACKAGES := libgloo-dev libhdf5-dev pkg-config g++

# tch 0.24 binds libtorch 2.11.0 from the venv's torch wheel (torch-sys runs the
# venv's `python` when VIRTUAL_ENV is set); build.rs sets the run-time rpath.
export VIRTUAL_ENV := $(VENV)
export PATH := $(VENV)/bin:$(HOME)/.cargo/bin:$(PATH)
export LIBTORCH_USE_PYTORCH := 1
export CARGO_TERM_COLOR := never

BIN := $(ROOT)/target/release/vrtspike
LAUNCH := $(ROOT)/target/release/vrtspike-launch

.PHONY: setup build test lint demo cache-demo bench clean

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

$(STAMPS)/venv: requirements.txt
	@mkdir -p $(STAMPS)
	@[ -x $(VENV)/bin/python ] || $(PYTHON) -m venv $(VENV)
	@if ! $(VENV)/bin/python -c "import torch,sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_VERSION)')" 2>/dev/null \
	    || ! $(VENV)/bin/python -c "import numpy, PIL" 2>/dev/null; then \
	  echo "installing torch==$(TORCH_VERSION) and the baseline's packages into $(VENV)"; \
	  $(VENV)/bin/pip install -q --disable-pip-version-check -r requirements.txt; \
	fi
	@touch $@

build: setup
	cargo build --release --workspace

lint: setup
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings

test: setup lint
	cargo test --workspace

DEMO_DATA := $(ROOT)/data/demo
DEMO_CONFIG := configs/demo/unet_spike_demo.yaml

demo: build
	@cd $(ROOT) && [ -f $(DEMO_DATA)/dataset.yaml ] || $(BIN) synth --out $(DEMO_DATA) --seqs 12 --test-seqs 4 --frames 12
	cd $(ROOT) && $(LAUNCH) --gpus 0 --ranks 2 --config $(DEMO_CONFIG)

cache-demo: build
	$(BIN) demo

bench: build
	$(BIN) bench cache --json

clean:
	cargo clean
