#!/bin/sh
# The packages a GPU machine's own Python lacks to run gpumarket (make gpu-check; issue 15),
# as wheels, and their installation there. Such a machine (CUDA, torch and transformers of
# its own, Python 3.12, no network) has grpcio, protobuf, click, aiohttp, rich, numpy,
# pillow, prometheus-client, nvidia-ml-py, safetensors and tokenizers, but not
# cryptography, sqlite-utils, grpcio-health-checking and grpcio-reflection.
#
#   scripts/gpu_wheels.sh download   # here, with network: the wheels into .whl/ (git-ignored)
#   scripts/gpu_wheels.sh install    # there: the wheels, then gpumarket itself (editable,
#                                    # no dependencies, no build isolation, nothing fetched)
#
# They go into the interpreter's own site-packages, not a --target directory on PYTHONPATH:
# the provider starts every job with a clean environment (no PYTHONPATH), so a job's Python
# must find gpumarket and its dependencies by itself.
#
# Besides the four missing packages: their dependencies that machine lacks (cffi and
# pycparser for cryptography; sqlite-fts4 and click-default-group for sqlite-utils), and, to
# be safe against older copies there, the versions this project's generated code and
# sqlite-utils need of grpcio (>= 1.85.1), protobuf (>= 7.35) and click (>= 8.3.1).
set -eu

PYTHON=${PYTHON:-python3}
DIR=${WHEELS_DIR:-.whl}
WHEELS="cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 sqlite-utils==4.2.1
sqlite-fts4==1.0.3 click-default-group==1.2.4 click==8.5.1 grpcio==1.85.3
grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2"

cd "$(dirname "$0")/.."
case "${1:-}" in
download)
    mkdir -p "$DIR"
    for wheel in $WHEELS; do
        "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 \
            --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DIR" "$wheel"
    done
    ls -1 "$DIR"
    echo "wheels in $DIR/; on the GPU machine: scripts/gpu_wheels.sh install (carry $DIR)"
    ;;
install)
    ls "$DIR"/*.whl >/dev/null 2>&1 || { echo "no wheels in $DIR/ (scripts/gpu_wheels.sh download, then carry $DIR)" >&2; exit 1; }
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        "$DIR"/*.whl
    "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e .
    "$PYTHON" -c "import gpumarket.provider.inventory, gpumarket.broker.cli, gpumarket.client.cli; print('gpumarket installed in', __import__('sys').executable)"
    ;;
*)
    echo "usage: scripts/gpu_wheels.sh download|install" >&2
    exit 2
    ;;
esac
