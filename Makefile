# kvserve: `make serve` runs the service on the embedded default model, `make test` runs
# the tests. Both create .venv and install what they need first.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# CPU hosts get the CPU wheel of torch; a host with an NVIDIA driver gets the default
# (CUDA) build from PyPI.
TORCH_SPEC := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch" || echo "torch==2.13.0")

.PHONY: install serve test protos lint bench gpu-check gpu-wheels clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH_SPEC)"
	$(VPY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/kvserve serve $(ARGS)

# The suite on TEST_WORKERS processes (pytest-xdist), a test file per worker at a time so
# that a module's shared services stay in one process; most tests wait on the processes
# they start, so two workers pay on two cores; TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

protos: $(STAMP)
	$(VPY) -m kvserve.v1.generate_stubs

# The comparison with HF transformers and llama-cpp-python; writes its table into
# docs/benchmarks.md.
bench: $(STAMP)
	$(VPY) bench/compare.py --docs $(ARGS)

# On a host with a CUDA device: `kvserve serve` on the GPU (two runners over CUDA IPC, HF
# parity, kill -9 of a runner), compiled kernels, serving throughput in Llama-3.1-8B's shape
# (bench/gpu_check.sh; ARGS="--device cpu" is the dry run). It needs no .venv: a GPU host
# without network runs it on its own python3 with the wheels `make gpu-wheels` put in .whl/.
gpu-check:
	PY=$(if $(wildcard $(VPY)),$(VPY),$(PY)) bash bench/gpu_check.sh $(ARGS)

gpu-wheels: $(STAMP)
	$(VPY) bench/gpu_wheels.py

lint: $(STAMP)
	$(VENV)/bin/ruff check kvserve tests bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
