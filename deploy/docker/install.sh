#!/bin/sh
# Install kvlb from a source tree into a new virtual environment: the Dockerfile's install step.
# tests/deploy/test_dockerfile.py runs this same script on a copy of the Docker build context, in a
# fresh venv, so CI checks the image's install without a Docker engine.
#   usage: install.sh VENV_DIR SOURCE_DIR
set -eu
VENV_DIR=$1
SOURCE_DIR=$2
PIP="$VENV_DIR/bin/pip --no-cache-dir --disable-pip-version-check --quiet"

python3 -m venv "$VENV_DIR"

# gRPC stubs are generated from proto/ at build time (as `make proto` does), with grpcio-tools
# installed only for that step, so the protobuf runtime is one the generator accepts.
if [ -d "$SOURCE_DIR/proto" ]; then
    OUT="$SOURCE_DIR/balancer/_proto"
    $PIP install grpcio-tools
    rm -rf "$OUT" && mkdir -p "$OUT"
    (cd "$SOURCE_DIR" && find proto -name '*.proto' -print0 | xargs -0 "$VENV_DIR/bin/python" -m grpc_tools.protoc \
        -I proto --python_out=balancer/_proto --pyi_out=balancer/_proto --grpc_python_out=balancer/_proto)
    find "$OUT" \( -name '*.py' -o -name '*.pyi' \) -exec \
        sed -i -E 's/^(from|import) kvlb\.v1( |\.)/\1 balancer._proto.kvlb.v1\2/' {} +
    find "$OUT" -type d -exec touch {}/__init__.py \;
    $PIP uninstall --yes grpcio-tools
fi

$PIP install "$SOURCE_DIR"
# Fail the build here, not at start-up, if an import or the command line is broken.
"$VENV_DIR/bin/python" -c "import balancer.app, balancer.discovery, replicas.command, loadtests.emulate"
"$VENV_DIR/bin/kvlb" serve --help >/dev/null
"$VENV_DIR/bin/kvlb" emulate --help >/dev/null  # a tool command: the entry points are installed
