#!/usr/bin/env bash
# Launch examples/ddp_torchrun.py on 2 processes of this node, with tba configured from TBA_*.
#   examples/torchrun.sh [--steps N ...]
# On a cluster, run the same on every node with --nnodes/--rdzv-endpoint, and keep
# TBA_SPILL_DIR on each node's local NVMe: each rank makes its own directory inside it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export TBA_SPILL_DIR="${TBA_SPILL_DIR:-/var/tmp/tba-$(id -u)}"  # node-local disk, not NFS
export TBA_MIN_OFFLOAD_BYTES="${TBA_MIN_OFFLOAD_BYTES:-256KiB}"
exec "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node="${NPROC:-2}" \
    "$here/ddp_torchrun.py" "$@"
