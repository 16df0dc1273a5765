#!/usr/bin/env bash
# The GPU check: dpwa's CUDA tests and a short comparison on the GPU, on a machine that has one.
#
#   scripts/gpu-check.sh [OUT_DIR]
#
# It runs with the python3 on PATH (or $PYTHON), which needs a CUDA build of torch, and dpwa's other
# dependencies (pyzmq, pyyaml, msgpack, numpy, cryptography, matplotlib for the curves) and pytest; it says
# which are missing. It writes into OUT_DIR (default: runs/gpu-check-DATE):
#   gpu.txt       the card(s), the driver, torch and its CUDA;
#   pytest.log    tests/test_cuda.py: the adapter, its kernels (a large model's chunked path too), the optimizer
#                 hook, checkpoints and a short comparison on the GPU (skipped where there is no GPU, as in CI);
#   memory.json and memory.log   python -m dpwa.bench --memory --device cuda: two nodes on the GPU in the
#                 default mode at 100M float32 parameters and at the largest bfloat16 model they hold (from
#                 the free device memory, /dev/shm and host memory; at most 4B): each row's step time
#                 against the same loop without dpwa, and the host and device memory dpwa added at its peak;
#   compare.json, compare.log and compare/   python -m dpwa.compare --device cuda on charlm's medium model
#                 (4.9 million parameters, more than the CPU machine the tables were made on can train),
#                 2 workers, gossip, gossip-lowbw, all-reduce (NCCL where each rank has its own GPU, else
#                 gloo) and DiLoCo.
# Each part has a time limit, so the whole script ends within 8 minutes (tests 2, memory rows 3, comparison
# 2.5), and each prints what it measured as it goes, even when a later part fails or runs out of time.
# Exit status: 0 when every CUDA test passed and the memory rows and the comparison completed; 2 without a
# GPU; 3 when a dependency is missing; 1 when a part failed or ran out of time. docs/performance.md ("On a
# GPU") keeps what it printed, with the card.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${1:-runs/gpu-check-$(date +%Y%m%d-%H%M%S)}
STEPS=${GPU_CHECK_STEPS:-200}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/lab${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1  # the library and its lab (lab/)

if ! "$PYTHON" - >"$OUT/gpu.txt" 2>&1 <<'EOF'
import sys
import torch
import torch.distributed
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
if not torch.cuda.is_available():
    print("no GPU: torch.cuda.is_available() is False")
    sys.exit(1)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")
if torch.distributed.is_nccl_available():
    version = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
    print(f"NCCL {'.'.join(map(str, version)) if isinstance(version, tuple) else version}")
else:
    print("no NCCL")
EOF
then
    cat "$OUT/gpu.txt"
    echo "gpu-check: no usable GPU here (above); nothing was run" >&2
    exit 2
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

missing=$("$PYTHON" - <<'EOF'
import importlib.util
names = {"zmq": "pyzmq", "yaml": "pyyaml", "msgpack": "msgpack", "numpy": "numpy", "cryptography": "cryptography",
         "matplotlib": "matplotlib", "pytest": "pytest"}
print(" ".join(pkg for mod, pkg in names.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$missing" ]; then
    echo "gpu-check: $PYTHON lacks: $missing (install them, or bring their wheels)" >&2
    exit 3
fi

status=0
echo "== tests/test_cuda.py"
timeout 120 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/pytest.log" || status=1

echo "== python -m dpwa.bench --memory --device cuda (100M float32, then the largest bfloat16 model that fits)"
timeout 180 "$PYTHON" -m dpwa.bench --memory --device cuda --json "$OUT/memory.json" --log "$OUT/memory-nodes.log" \
    2>&1 | tee "$OUT/memory.log" || status=1

echo "== python -m dpwa.compare --device cuda --workload charlm --model medium --workers 2 --steps $STEPS"
timeout 150 "$PYTHON" -m dpwa.compare --device cuda --workload charlm --model medium --workers 2 --steps "$STEPS" \
    --systems gossip,gossip-lowbw,allreduce,diloco --json "$OUT/compare.json" --out "$OUT/compare" \
    2>&1 | tee "$OUT/compare.log" || status=1
exit $status
