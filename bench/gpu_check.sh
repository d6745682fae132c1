#!/usr/bin/env bash
# Every GPU check in one command (`make gpu-check`), for a host with a CUDA device:
#   packages     the wheels of `make gpu-wheels` (.whl/, for a host without network) are
#                installed into a private target dir when kvserve's imports fail without them
#   correctness  bench/gpu_serve.py correctness: `kvserve serve --device cuda --runners 2` on a
#                tiny random model made on the spot, pool shared through CUDA IPC, 16 greedy
#                streams == HF on the GPU == kvserve on CPU; kill -9 of a runner mid-stream;
#                GPU memory back after shutdown
#   kernels      compiled Triton kernels vs kernels/reference.py at realistic sizes and CUDA IPC
#                between two processes (pytest -m gpu)
#   throughput   bench/gpu_serve.py throughput: random bf16 weights in Llama-3.1-8B's shape at
#                1, 64 and 256 streams beside the bare torch loop
#   kernel-bench bench/gpu_kernels.py: decode bandwidth against the peak, extend TFLOP/s
# Each stage has a time limit; a stage that fails does not stop the ones after it, a stage
# that cannot start (no device, missing packages) stops the run at once. At most 8 result
# files go to $OUT (default /tmp/kvserve-gpu): device.txt, gpu_check.log, correctness.json,
# kernels.txt, throughput.json, serve_256.png, serve.log.
#   bash bench/gpu_check.sh [--device cpu] [--stages correctness,kernels]
# --device cpu is the dry run CI does (tests/ops/test_gpu_check.py): the tiny model on CPU,
# the kernel benchmark's tiny shapes in Triton's interpreter, no throughput stage.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-/tmp/kvserve-gpu}
DEVICE=cuda
STAGES=correctness,kernels,throughput,kernel-bench
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=$2; shift 2 ;;
        --stages) STAGES=$2; shift 2 ;;
        *) echo "gpu_check: unknown argument $1 (--device cuda|cpu, --stages a,b)" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1  # every model of the check is made on the spot
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
START=$SECONDS
stamp() { echo "== gpu_check $(date -u +%H:%M:%S) +$((SECONDS - START)) s: $*"; }
wants() { [[ ",$STAGES," == *",$1,"* ]]; }
cannot_start() { stamp "stage $1 cannot start: $2"; exit 3; }

IMPORTS="import zmq, msgspec, gguf, grpc_health.v1.health, grpc_reflection.v1alpha.reflection, fastapi, uvicorn
import kvserve.v1.generator_pb2_grpc, kvserve.frontend.main, kvserve.runner.main, kvserve.memsvc.server"
stamp "packages"
if ! "$PY" -c "$IMPORTS" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        SITE=${KVSERVE_GPU_SITE:-/tmp/kvserve-site}
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl || cannot_start packages "pip could not install .whl/*.whl"
        export PYTHONPATH="$SITE:$PYTHONPATH"
        echo "installed $(ls .whl/*.whl | wc -l) wheels into $SITE"
    fi
    "$PY" -c "$IMPORTS" || cannot_start packages "kvserve's imports fail (make install, or make gpu-wheels on a host with network and carry .whl/)"
fi

"$PY" - "$DEVICE" <<'EOF' | tee "$OUT/device.txt"
import platform, subprocess, sys
import torch, triton
device = sys.argv[1]
print(f"python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}, "
      f"cuda {torch.version.cuda}")
if device.startswith("cuda"):
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (--device cpu runs the dry run)")
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True)
    print(f"nvidia-smi: {smi.stdout.strip() or smi.stderr.strip()}")
else:
    flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    print(f"dry run on CPU: {platform.processor() or platform.machine()}, "
          f"{' '.join(f for f in flags if f.startswith(('avx', 'amx')))}")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || cannot_start device "no usable $DEVICE device"

failed=()
run_stage() {  # name, time limit in s, command...
    local name=$1 limit=$2; shift 2
    stamp "stage $name (limit ${limit} s)"
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    stamp "stage $name exit $rc"
    [ "$rc" -eq 0 ] || failed+=("$name:$rc")
}

if wants correctness; then
    run_stage correctness 200 "$PY" bench/gpu_serve.py correctness --device "$DEVICE" --out "$OUT"
fi
if wants kernels; then
    if [[ $DEVICE == cuda* ]]; then
        run_stage kernels 150 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -m gpu \
            tests/kernels/test_gpu.py tests/memsvc/test_gpu.py > >(tee -a "$OUT/kernels.txt") 2>&1
    else
        stamp "stage kernels: needs CUDA, skipped in the dry run"
    fi
fi
if wants throughput; then
    if [[ $DEVICE == cuda* ]]; then
        run_stage throughput 270 "$PY" bench/gpu_serve.py throughput --out "$OUT"
    else
        stamp "stage throughput: needs CUDA, skipped in the dry run"
    fi
fi
if wants kernel-bench; then
    if [[ $DEVICE == cuda* ]]; then
        run_stage kernel-bench 150 "$PY" bench/gpu_kernels.py > >(tee -a "$OUT/kernels.txt") 2>&1
    else
        run_stage kernel-bench 60 env TRITON_INTERPRET=1 "$PY" bench/gpu_kernels.py --dry-run \
            > >(tee -a "$OUT/kernels.txt") 2>&1
    fi
fi
sleep 0.2  # the tee processes flush
stamp "done in $((SECONDS - START)) s; failed stages: ${failed[*]:-none}"
[ "${#failed[@]}" -eq 0 ]
