#!/usr/bin/env bash
# Every GPU check in one command, for a host with a CUDA device:
#   1. the Triton kernels compiled for real against kernels/reference.py at realistic sizes
#      (tests/kernels/test_gpu.py), and CUDA IPC of memsvc's buffers between two processes
#      (tests/memsvc/test_gpu.py);
#   2. bench/gpu_kernels.py: decode bandwidth and extend TFLOP/s (about 3 minutes on an H100).
# It needs only python3 with torch (CUDA build), triton, msgspec, pytest and pytest-timeout:
# nothing is installed, so it also runs on a bare GPU box with the repo copied over.
#   bash bench/gpu_check.sh            # logs also go to $OUT (default /tmp/kvserve-gpu)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-/tmp/kvserve-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

"$PY" - <<'EOF' | tee "$OUT/device.txt"
import torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, cuda {torch.version.cuda}")
if not torch.cuda.is_available():
    raise SystemExit("gpu_check: no CUDA device")
print(f"device: {torch.cuda.get_device_name()}, "
      f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 2

"$PY" -m pytest -q -p no:cacheprovider -o addopts="" -m gpu \
    tests/kernels/test_gpu.py tests/memsvc/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
tests=${PIPESTATUS[0]}

timeout 420 "$PY" bench/gpu_kernels.py 2>&1 | tee "$OUT/gpu_kernels.txt"
bench=${PIPESTATUS[0]}

echo "gpu_check: tests exit $tests, benchmark exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
