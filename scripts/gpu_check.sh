#!/usr/bin/env bash
# The CUDA data plane's device check, in one run: environment, CUDA tests, calibration, transfer benchmark.
#
# Run from the repository root on a machine with an NVIDIA GPU. Results go under $OUT (default ./gpu_check_out),
# at most 9 files:
#   summary.txt        one line per step with its exit status, then the benchmark table
#   env.txt            python, torch, CUDA, GPU, pinned-memory and zero-copy probes
#   cuda_tests.txt     the CUDA conformance and ordering tests (dma path, auto path, emulated)
#   bench.txt / bench.json   run_transfer_bench(quick=False) on cuda and cpu (dma path only)
#   kernel_tests.txt   the tests of the opt-in zero-copy kernel path (own process: a fault there can't hide the rest)
#   bench_kernel.txt   the quick CUDA benchmark with the kernel path enabled (calibration picks per job)
#   all_tests.txt      the whole suite on this machine (the reference engine then runs on CUDA)
#   vllm_tests.txt     KvfsmConnector in vLLM's real Scheduler over CUDA KV caches (when vLLM is installed)
#   (the calibration table, dma and kernel paths, is printed into summary.txt)
#
# Dependencies. kvfsm needs torch (CUDA build), numpy and transitions; the tests need pytest and hypothesis.
#   - With a package index reachable, a virtualenv gets them:  pip install -e '.[torch,test]'  (CUDA torch wheel).
#   - Without one (this workplace's GPU machines reach nothing), the image's python3 already has torch, numpy,
#     pytest and hypothesis; carry the pure-Python `transitions` wheel in ./.whl (see the device README), e.g.
#       here:   python3 -m pip download --no-deps --only-binary=:all: -d .whl transitions==0.9.3
#       there:  run tool, carry [".whl"], command "bash scripts/gpu_check.sh"
#     The script installs ./.whl/*.whl into /tmp/kvfsm-site and runs kvfsm from the source tree (PYTHONPATH).
#
# Usage: bash scripts/gpu_check.sh [--quick]      (--quick: 32 MiB transfers instead of 256 MiB)
# Budget: under 10 minutes (one device command); every step has its own timeout, the important ones first.

set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_check_out}"
mkdir -p "$OUT"
QUICK=0
[[ "${1:-}" == "--quick" ]] && QUICK=1
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

step() {  # step NAME TIMEOUT_S LOGFILE CMD...
    local name=$1 limit=$2 log=$3
    shift 3
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    echo "$(printf '%-22s' "$name") rc=$rc  $((SECONDS - t0))s  (log: $(basename "$log"))" | tee -a "$SUMMARY"
    return $rc
}

# ------------------------------------------------------------------------------------------ dependencies
if [[ -d .whl ]] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvfsm-site \
        .whl/*.whl >>"$OUT/env.txt" 2>&1 && export PYTHONPATH="/tmp/kvfsm-site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c "import torch, numpy, transitions, pytest, hypothesis; assert torch.cuda.is_available()" 2>/dev/null; then
    # A machine with a package index: a virtualenv with the project's extras (CUDA torch from the index).
    if "$PY" -m venv /tmp/kvfsm-venv >>"$OUT/env.txt" 2>&1 &&
        timeout 600 /tmp/kvfsm-venv/bin/pip install -q -e '.[torch,test]' >>"$OUT/env.txt" 2>&1; then
        PY=/tmp/kvfsm-venv/bin/python
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step env 60 "$OUT/env.txt" "$PY" - <<'EOF'
import platform, sys
print("python", sys.version.split()[0], platform.machine())
import numpy, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "numpy", numpy.__version__)
import transitions
print("transitions", getattr(transitions, "__version__", "?"))
assert torch.cuda.is_available(), "no CUDA device visible"
p = torch.cuda.get_device_properties(0)
print("gpu", p.name, f"{p.total_memory / 2**30:.0f} GiB", p.multi_processor_count, "SMs")
from kvfsm.data import CPUSlotPool
from kvfsm.data.cuda import CudaDevice
pool = CPUSlotPool(64, 2, (2, 8, 16, 128), 4, torch.bfloat16)
print("pool pinned", pool.pinned, "ranges", pool.pinned_ranges, "bytes", pool.nbytes)
alias = CudaDevice(torch.device("cuda")).host_alias(pool.rows.view(torch.int64))
print("zero-copy alias of the pinned pool:", alias is not None)
if alias is not None:
    pool.rows.view(torch.int64)[3].fill_(123)
    print("  device reads host write:", bool((alias[3] == 123).all().item()))
    alias[5].fill_(77); torch.cuda.synchronize()
    print("  host reads device write:", bool((pool.rows.view(torch.int64)[5] == 77).all().item()))
pool.close()
from kvfsm.data.cuda.device import _memcpy_async
print("cudaMemcpyAsync through ctypes (self-tested):", _memcpy_async() is not None)
EOF
[[ $? -ne 0 ]] && { echo "environment not usable; see env.txt" | tee -a "$SUMMARY"; exit 1; }

# Steps in order of importance, each with its own limit (under 10 minutes in all).
# ------------------------------------------------------------------------------------------ CUDA tests
step cuda-tests 150 "$OUT/cuda_tests.txt" "$PY" -m pytest -q -rs -p no:cacheprovider \
    tests/test_backend_conformance.py tests/test_cuda_ordering.py -k "not kernel"

# ------------------------------------------------------------------------------------------ benchmark
BENCH_ARGS=(--json "$OUT/bench.json")
[[ $QUICK -eq 1 ]] && BENCH_ARGS+=(--quick)
step bench 120 "$OUT/bench.txt" "$PY" -m kvfsm.bench.transfers "${BENCH_ARGS[@]}"

# ------------------------------------------------------------------------------------------ zero-copy kernel path
step kernel-tests 60 "$OUT/kernel_tests.txt" env KVFSM_CUDA_KERNEL_COPY=1 "$PY" -m pytest -q -rs \
    -p no:cacheprovider tests/test_backend_conformance.py tests/test_cuda_ordering.py -k "kernel or auto"
step bench-kernel 60 "$OUT/bench_kernel.txt" env KVFSM_CUDA_KERNEL_COPY=1 "$PY" -m kvfsm.bench.transfers \
    --quick --backend cuda

# ------------------------------------------------------------------------------------------ calibration
step calibration 30 "$OUT/summary.txt" "$PY" - <<'PYEOF'
import torch
from kvfsm.data.cuda import CudaDevice, cuda_calibration
table = cuda_calibration(CudaDevice(torch.device("cuda")), kernel=True)
print(f"calibration: {table.seconds:.1f} s, paths {table.paths()}")
for row in table.summary():
    print(f"  {row['path']:<14} {row['unit_bytes']:>8} B x {row['count']:<5} {row['gbps']:7.2f} GB/s")
PYEOF

# ------------------------------------------------------------------------------------------ vLLM integration
# KvfsmConnector inside vLLM's real Scheduler with CUDA KV caches: tests/vllm/test_connector_cuda.py (the CUDA copy
# backend, bytes checked in GPU memory) and the CPU suite with its caches on the GPU (KVFSM_VLLM_DEVICE=cuda).
# Needs vLLM 0.33 in this Python (kvfsm[vllm]); without it the step records a skip instead of failing.
if "$PY" -c "import vllm.v1.core.sched.scheduler" >/dev/null 2>&1; then
    step vllm-cuda 150 "$OUT/vllm_tests.txt" env KVFSM_VLLM_DEVICE=cuda HF_HUB_OFFLINE=1 "$PY" -m pytest -q -rs \
        -p no:cacheprovider tests/vllm/test_connector_cuda.py tests/vllm/test_connector.py
else
    echo "$(printf '%-22s' vllm-cuda) skipped: vLLM is not installed in $PY (pip install 'kvfsm[vllm]')" | tee -a "$SUMMARY"
fi

# ------------------------------------------------------------------------------------------ the whole suite
step all-tests 120 "$OUT/all_tests.txt" "$PY" -m pytest -q -p no:cacheprovider --maxfail=20 \
    --ignore=tests/test_packaging.py

echo >>"$SUMMARY"
cat "$OUT/bench.txt" >>"$SUMMARY"
echo "done: $SUMMARY"
