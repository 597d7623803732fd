#!/usr/bin/env bash
# The GPU check as one call on a lent GPU machine that runs a command over a copy of this
# checkout and returns a few files: benchmarks/gpu/check.sh with the wheels of gpu-wheels/
# (benchmarks/gpu/carry.sh) when they came along, within BUDGET_S (default 540 s, which leaves
# a 10-minute call room for its transfers), then summary.txt, check.json, log.txt and every
# step's output in one archive copied to RESULTS (default $OUT when set, else gpu-check-out).
#
#   bash benchmarks/gpu/run_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${RESULTS:-${OUT:-gpu-check-out}}
export OUT_DIR=${OUT_DIR:-/tmp/tba-gpu-check-out}
export BUDGET_S=${BUDGET_S:-540}
[ -d gpu-wheels/kvikio ] && export KVIKIO_WHEELS=${KVIKIO_WHEELS:-gpu-wheels/kvikio}
[ -d gpu-wheels/torchtune ] && export TORCHTUNE_WHEELS=${TORCHTUNE_WHEELS:-gpu-wheels/torchtune}
echo "run_check: $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)," \
    "BUDGET_S=$BUDGET_S, kvikio wheels: ${KVIKIO_WHEELS:-none}, torchtune wheels: ${TORCHTUNE_WHEELS:-none}"
# The copy's git history can lag its tree (2026-12-04: a 098d73f tree said 8df3dd9): the
# commit written beside the wheels just before the call (docs/gpu.md) is the one to trust.
[ -f gpu-wheels/COMMIT ] && echo "run_check: tree of $(cat gpu-wheels/COMMIT) (gpu-wheels/COMMIT)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
benchmarks/gpu/check.sh
rc=$?
mkdir -p "$RESULTS"
for f in summary.txt check.json log.txt; do
    [ -f "$OUT_DIR/$f" ] && cp "$OUT_DIR/$f" "$RESULTS/"
done
tar czf "$RESULTS/gpu-check-out.tar.gz" -C "$OUT_DIR" .
echo "run_check: rc=$rc; results in $RESULTS (summary.txt, check.json, log.txt, gpu-check-out.tar.gz)"
exit $rc
