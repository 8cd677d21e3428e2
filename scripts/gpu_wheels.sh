#!/usr/bin/env bash
# Download, for an offline CUDA machine whose Python already has torch, triton and transformers,
# the wheels of the other packages the engine and its tests import, at the versions installed
# here (run it in the project's environment). Then, on that machine:
#
#   WHEEL_DIR=<dir> bash scripts/gpu_checks.sh
#
#   bash scripts/gpu_wheels.sh [DIR] [PYTHON_VERSION]      # default: .whl, 3.12
set -eu
DIR=${1:-.whl}
PYVER=${2:-3.12}
PACKAGES="pyzmq fastapi starlette uvicorn orjson pydantic pydantic-core annotated-types
typing-inspection opentelemetry-api gguf"
mkdir -p "$DIR"
for name in $PACKAGES; do
    version=$(python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR" \
        "$name==$version"
done
ls "$DIR"
