#!/usr/bin/env bash
# The GPU checks of docs/cuda_graph.md in one run: the GPU tests (CUDA graphs, pause, memory,
# the fused sampler on the device), then the CUDA benchmarks on a SmolLM2-shaped model.
#
#   bash scripts/gpu_checks.sh [LOG_DIR]        # from the repository root, on a CUDA machine
#
# Each part has its own time limit and the run goes on after a failure; the logs land in
# LOG_DIR (default: gpu-logs). SMOL_DIR (default models/SmolLM2-135M-Instruct) is the model
# benchmarked; a directory holding only its config.json and tokenizer files gets random
# weights of that shape first (speed does not depend on the values). Environment: WHEEL_DIR,
# a folder of wheels installed first (for a machine without a registry: scripts/gpu_wheels.sh
# downloads them); PARTS, the parts to run (default: all, "tests bench overlap prefill steps
# steps-eager sampling verify launch suites").
#
# On an H100 the tests part takes about 4 minutes (each test starts its own engines), the
# suites about 3-4, the benchmarks together about 4 (--cuda-graph-compare's torch_native run
# alone can outlast the bench part's limit): run them as two calls (PARTS="tests suites", then
# PARTS="bench overlap prefill steps steps-eager sampling verify launch") where one command's
# time is limited to 10 minutes.
set -u
cd "$(dirname "$0")/.."
LOG_DIR=${1:-gpu-logs}
SMOL_DIR=${SMOL_DIR:-models/SmolLM2-135M-Instruct}
PARTS=${PARTS:-tests bench overlap prefill steps steps-eager sampling verify launch suites}
mkdir -p "$LOG_DIR"
export PYTHONPATH="$PWD/python:$PWD/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

if [ -n "${WHEEL_DIR:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu-site "$WHEEL_DIR"/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/gpu-site"
fi

part() {  # part NAME SECONDS COMMAND...: run one part under a time limit, log it, go on
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date +%T), limit ${limit}s)"
    timeout "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
    echo "== $name rc=$? ($(date +%T))"
}

if [ ! -f "$SMOL_DIR/model.safetensors" ]; then
    part random-weights 120 python3 - "$SMOL_DIR" <<'EOF'
import sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM
path = sys.argv[1]
config = AutoConfig.from_pretrained(path)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained(path)
print("random weights written to", path)
EOF
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$LOG_DIR/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >>"$LOG_DIR/gpu.txt"

for p in $PARTS; do
    case $p in
    tests)
        part tests 300 python3 -m pytest -q -p no:cacheprovider --timeout 90 --tb=short \
            test/srt/test_cuda_graph_gpu.py test/srt/test_fused_elementwise.py \
            test/srt/test_decode_attention_kernel.py test/srt/test_cuda_graph_runner.py \
            test/srt/test_entropy_kernel.py test/srt/test_batch_invariant_kernels.py \
            -k "not compiles" ;;
    bench)
        part bench 170 python3 benchmark/bench_offline_throughput.py --model-path "$SMOL_DIR" \
            --dtype bfloat16 --device cuda --cuda-graph-compare --num-prompts 256 \
            --pause-rounds 0 --skip-hf ;;
    overlap)
        part overlap 120 python3 benchmark/bench_offline_throughput.py --model-path "$SMOL_DIR" \
            --dtype bfloat16 --device cuda --overlap-compare --num-prompts 256 \
            --pause-rounds 0 --skip-hf ;;
    prefill)
        part prefill 120 python3 benchmark/bench_offline_throughput.py --model-path "$SMOL_DIR" \
            --dtype bfloat16 --device cuda --prefill-graph-compare --num-prompts 256 \
            --pause-rounds 0 --skip-hf ;;
    steps)
        part steps 60 python3 benchmark/bench_step_breakdown.py --model-path "$SMOL_DIR" \
            --dtype bfloat16 --device cuda --host-profile ;;
    steps-eager)
        part steps-eager 60 python3 benchmark/bench_step_breakdown.py --model-path "$SMOL_DIR" \
            --dtype bfloat16 --device cuda --disable-cuda-graph ;;
    sampling)
        part sampling 90 python3 benchmark/bench_sampling.py --device cuda ;;
    verify)
        part verify 60 python3 benchmark/bench_sampling.py --device cuda --verify-compare ;;
    launch)
        part launch 40 python3 benchmark/bench_cuda_launch.py ;;
    suites)
        part suites 300 python3 -m pytest -q -p no:cacheprovider --timeout 90 --tb=short \
            test/srt/test_engine_pause.py \
            test/srt/test_memory_occupation.py test/srt/test_engine_determine_generation.py \
            test/srt/test_overlap_schedule.py test/srt/test_entropy_e2e.py \
            test/srt/test_http_pause.py ;;
    esac
done
grep -hE "^(sglang|vLLM|HF|ratio|cuda|B=|backend|[0-9]+ (passed|failed))|passed|failed|Error" \
    "$LOG_DIR"/*.log | tail -60
