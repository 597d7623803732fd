#!/usr/bin/env bash
# Fetches the wheels the GPU check installs on a machine with no network (docs/gpu.md,
# "Carrying wheels"), on a machine that reaches the package registry, into gpu-wheels/
# (ignored by git): kvikio/ (kvikio, libkvikio, rapids-logger: about 4 MB; the GPU image has
# cuda-pathfinder and nvidia-cufile) and torchtune/ (torchtune 0.6.1, the torchao it imports,
# omegaconf: about 6 MB). benchmarks/gpu/run_check.sh picks them up from there.
#
#   benchmarks/gpu/carry.sh [DIR]     # DIR defaults to gpu-wheels
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-gpu-wheels}
PY=${PYTHON:-python3}
# The GPU image's interpreter is CPython 3.12 on x86-64; pip matches each manylinux tag exactly.
TAGS=(--only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64)
fetch() {
    local into=$1
    shift
    rm -rf "$into"
    mkdir -p "$into"
    "$PY" -m pip download -q --disable-pip-version-check --no-deps "${TAGS[@]}" -d "$into" "$@"
}
fetch "$DIR/kvikio" "kvikio-cu13==26.10.*" "libkvikio-cu13==26.10.*" "rapids-logger==0.3.*"
# torchtune 0.6.1 needs a torchao that still has torchao.dtypes.nf4tensor (0.11.0; 0.18.0 lacks
# it); omegaconf 2.4 needs no antlr (2.3's antlr 4.9 has no wheel)
fetch "$DIR/torchtune" torchtune==0.6.1 torchao==0.11.0 "omegaconf>=2.4"
# the tree this is for (run_check.sh prints it; write it again before each call if HEAD moved)
echo "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo +dirty)" >"$DIR/COMMIT"
du -sh "$DIR"/* | sed 's/^/carry: /'
find "$DIR" -name "*.whl" | sort | sed "s/^/carry:   /"
