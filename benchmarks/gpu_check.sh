#!/usr/bin/env bash
# The GPU checks as one prepared script, for a session that is lent a GPU machine.
#
#   bash benchmarks/gpu_check.sh fetch   # on this machine: the wheels the GPU image lacks
#                                        # (megatron-core, pyzmq, submitit for its Python 3.12)
#                                        # into .whl/ (git-ignored), ~3.5 MiB
#   bash benchmarks/gpu_check.sh run     # on the GPU machine (device run, carry [".whl"]):
#                                        # install them into /tmp/site, then run the checks;
#                                        # everything lands under $OUT (default ./gpu-out)
#
# The checks: the CUDA tests (tests/gpu: the side-stream snapshot copy, bf16 casts, the
# tiny GPT in bf16 on one GPU with an async checkpoint and a resume, and the bf16 state
# after a resume equal to the saved one bit for bit with the optimizer Megatron picks on a
# GPU: fused when Transformer Engine or Apex is installed), then
# benchmarks/step_overhead.py --quick on the GPU, then benchmarks/gpu_size.py: a 125M
# modern-shape GPT (RMSNorm, SwiGLU, rope, GQA) in bf16 through the controller, tokens/s,
# MFU and peak CUDA memory beside the plan's estimate, plain and with int8 activation
# storage (200 steps each); then, where the image has vLLM (pip install 'baton[vllm]': too big
# to carry as a wheel), benchmarks/rollout.py --quick --device cuda: rollout tokens/s of Baton's
# vLLM rollout beside the same engine driven directly, and of the Megatron engine (skipped,
# with a line saying so, without vLLM). About 9 minutes on an H200, 12 with vLLM.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=("megatron-core==0.16.1" "pyzmq==27.3.0" "submitit==1.5.4")

case "${1:-}" in
fetch)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}" || exit 1
    ls -l .whl
    ;;
run)
    out=${OUT:-gpu-out}
    mkdir -p "$out"
    ls .whl/*.whl >/dev/null 2>&1 || { echo "gpu_check: no wheels in .whl/; run 'bash $0 fetch' first and carry .whl" >&2; exit 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
    rc=0
    { nvidia-smi -L
      python3 -c "import torch, megatron.core, zmq, h5py; print('torch', torch.__version__, torch.cuda.get_device_name(),
      '| megatron-core', megatron.core.__version__, '| pyzmq', zmq.__version__, '| h5py', h5py.__version__)"
    } 2>&1 | tee "$out/versions.txt"
    python3 -m pytest -q -p no:cacheprovider -o addopts="" -rA tests/gpu 2>&1 | tee "$out/tests_gpu.txt" || rc=1
    timeout 300 python3 benchmarks/step_overhead.py --quick --json "$out/step_overhead.json" \
        parallel.tp=1 parallel.pp=1 trainer.n_gpus_per_node=1 trainer.device=cuda 2>&1 | tee "$out/step_overhead.txt" || rc=1
    timeout 240 python3 benchmarks/gpu_size.py --steps 200 --json "$out/gpu_size.json" 2>&1 | tee "$out/gpu_size.txt" || rc=1
    if python3 -c "import vllm" >/dev/null 2>&1; then
        timeout 300 python3 benchmarks/rollout.py --quick --device cuda --json "$out/rollout.json" 2>&1 \
            | tee "$out/rollout.txt" || rc=1
    else
        echo "gpu_check: vllm is not installed here (pip install 'baton[vllm]'); benchmarks/rollout.py skipped" \
            | tee "$out/rollout.txt"
    fi
    exit $rc
    ;;
*)
    echo "usage: bash $0 fetch | run" >&2
    exit 2
    ;;
esac
