#!/usr/bin/env bash
# The GPU check (docs/gpu.md, "The GPU check"): one command for a bare GPU machine with no network
# whose python already has torch with CUDA. In order, each step timed and logged, the most
# telling first so that a short budget still yields them:
#   1. install tba from this checkout without fetching anything (builds the native engine);
#      kvikio and torchtune wheels carried in $KVIKIO_WHEELS and $TORCHTUNE_WHEELS (directories,
#      benchmarks/gpu/carry.sh fills them) are installed the same way;
#   2. pytest -m gpu: every CUDA and kvikio test (kvikio's skip when it does not import);
#   3. the GPU benchmark (benchmarks/gpu/bench_gpu.py: ~1B Llama-shaped, bf16, tba's modes
#      against no tba, checkpointing, save_on_cpu and torchtune) at seq 4096;
#   4. the overhead benchmark (benchmarks/bench_overhead.py --device cuda: tba's modes against no
#      tba and checkpointing on the launch-bound model and W1);
#   5. the kvikio backend: which mode it runs in (GDS or compat), its tests (the fake's, the gpu
#      one, tests/storage/test_kvikio_real.py) and, when kvikio imports, the GPU benchmark's
#      none and tba modes on TBA_BACKEND=kvikio;
#   6. the GPU benchmark again at 16384 with fewer steps (bench_long), where the disk matters;
#   7. the relay benchmark (benchmarks/gpu/bench_relay_gpu.py: tba.relay on the device against
#      plain gradient accumulation, W1's blocks);
#   8. tba doctor --json;
#   9. the CPU suite on this machine's torch (not the integrations: their frameworks are not
#      installed here) with the time left, in parallel when pytest-xdist is installed.
# Each step has a cap of its own (below) and never outlasts the budget; a step with under
# MIN_STEP_S left is recorded as skipped.
# Writes $OUT_DIR/check.json (every step's status, seconds and result) and
# $OUT_DIR/summary.txt. Exit status: 0 when every step that ran passed.
#
#   benchmarks/gpu/check.sh            # on the GPU machine (make gpu-check)
#   benchmarks/gpu/check.sh --dry      # anywhere, < 1 min: collects the GPU tests and prints
#                                      # why each skips, runs the benchmarks on tiny models,
#                                      # says whether kvikio imports
# Environment: PYTHON (default python3), OUT_DIR (default gpu-check-out), TBA_SPILL_DIR (the
# spill dir for tests and benchmark; default: a temporary dir), BUDGET_S (default 540: one
# 10-minute device call with room for the transfers; the CPU suite takes what is left).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
DRY=0
[ "${1:-}" = "--dry" ] && DRY=1
# Before anything: the interpreter the check will use, and what it lacks (exit 2, no step run).
preflight() {
    local why
    if ! command -v "$PY" >/dev/null 2>&1; then
        why="PYTHON=$PY is not an executable on this machine"
    elif ! "$PY" -c "import torch" >/dev/null 2>&1; then
        why="$PY ($("$PY" --version 2>&1)) has no torch: $("$PY" -c 'import torch' 2>&1 | tail -1)"
    elif [ $DRY -eq 0 ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
        why="$PY has torch $("$PY" -c 'import torch; print(torch.__version__)') but sees no CUDA device"
    else
        if ! "$PY" -c "import pytest" >/dev/null 2>&1; then
            echo "gpu-check: $PY has no pytest: the test steps will fail; carry its wheels (docs/gpu.md, Carrying wheels)" >&2
        fi
        return 0
    fi
    echo "gpu-check: $why." >&2
    echo "gpu-check: it needs a python with torch built for CUDA (and pytest); point it there:" >&2
    echo "gpu-check:   make gpu-check PYTHON=/path/to/python   (or PYTHON=... benchmarks/gpu/check.sh)" >&2
    exit 2
}
preflight

OUT_DIR=${OUT_DIR:-gpu-check-out}
BUDGET_S=${BUDGET_S:-540}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOG="$OUT_DIR/log.txt"
: >"$LOG"
STEPS="$OUT_DIR/steps.jsonl"
: >"$STEPS"
START=$SECONDS
export PYTHONUNBUFFERED=1
if [ -z "${TBA_SPILL_DIR:-}" ]; then
    TBA_SPILL_DIR=$(mktemp -d /var/tmp/tba-gpu-check.XXXXXX)
    trap 'rm -rf "$TBA_SPILL_DIR"' EXIT  # ours: leave nothing behind
fi
export TBA_SPILL_DIR

# run NAME CAP CMD...: runs CMD within CAP seconds or what the budget has left, whichever is
# less (output to the log and to NAME.txt), and records the result. With under MIN_STEP_S
# left the step is not started: it is recorded as skipped, which the summary lists apart
# (`timeout 0` would mean no limit at all).
MIN_STEP_S=20
RESERVE_S=10  # for summarize.py at the end
run() {
    local name=$1 cap=$2
    shift 2
    local t0=$SECONDS rc limit
    limit=$(( $(left) - RESERVE_S ))
    [ "$limit" -gt "$cap" ] && limit=$cap
    if [ "$limit" -lt "$MIN_STEP_S" ]; then
        echo "== $name: not run: $(left) s of the ${BUDGET_S} s budget left" | tee -a "$LOG"
        printf '{"step": "%s", "rc": 0, "seconds": 0, "timed_out": false, "skipped": true}\n' \
            "$name" >>"$STEPS"
        return 0
    fi
    echo "== $name (at most $limit s): $*" | tee -a "$LOG"
    timeout --signal=TERM --kill-after=15 "$limit" "$@" >"$OUT_DIR/$name.txt" 2>&1
    rc=$?
    tail -n 40 "$OUT_DIR/$name.txt" | tee -a "$LOG"
    printf '{"step": "%s", "rc": %d, "seconds": %d, "timed_out": %s}\n' "$name" "$rc" \
        "$((SECONDS - t0))" "$([ $rc -eq 124 ] && echo true || echo false)" >>"$STEPS"
    echo "== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
    return 0
}
left() { echo $((BUDGET_S - (SECONDS - START))); }

# Which path the kvikio backend takes here, in one line: GDS (cuFile moves device buffers) or
# compat mode (POSIX through host memory). kvikio is optional: not importing is no failure;
# importing and failing its probe is one on a GPU machine (exit 1), not in the dry run.
KVIKIO_MODE='
import sys
from tba.config import Config
from tba.storage.kvikio import KvikioBackend, KvikioUnavailable, kvikio_status
st = kvikio_status()
print("kvikio:", st["reason"])
if not st["importable"]:
    print("kvikio backend: not run (kvikio does not import)")
    sys.exit(0)
try:
    b = KvikioBackend(Config(backend="kvikio"))
except KvikioUnavailable as e:
    print(f"kvikio backend: unavailable: {e}")
    sys.exit(0 if sys.argv[1] == "1" else 1)
with b:
    mode = "GDS (cuFile, device buffers direct)" if b.device_direct else "compat mode (POSIX)"
    print(f"kvikio backend: {mode}; {b.reason}")
'
kvikio_imports() { (cd /tmp && "$PY" -c "import kvikio" >/dev/null 2>&1); }

if [ $DRY -eq 1 ]; then
    # Dry mode (CI, no GPU): the tree's own tba; the GPU tests are collected and each skip's
    # reason printed; the benchmark runs its tiny model; no install, no CPU suite.
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    run gpu_tests 120 "$PY" -m pytest -m gpu -rs -q -p no:cacheprovider tests
    run bench 120 "$PY" benchmarks/gpu/bench_gpu.py --dry --profile tba --json "$OUT_DIR/bench.json"
    # the second run's path, kept short: three modes
    run bench_long 120 "$PY" benchmarks/gpu/bench_gpu.py --dry --seq 256 --warmup 1 --steps 1 \
        --modes none,tba,auto@0.35 --json "$OUT_DIR/bench_long.json"
    run relay_bench 120 "$PY" benchmarks/gpu/bench_relay_gpu.py --dry \
        --json "$OUT_DIR/relay_bench.json"
    run overhead 120 "$PY" benchmarks/bench_overhead.py --models launch --rounds 2 --warmup 1
    run doctor 60 "$PY" -m tba.cli doctor --json --probe-bytes 16MiB
    run kvikio_mode 60 "$PY" -c "$KVIKIO_MODE" 1
else
    run install 120 "$PY" -m pip install --no-deps --no-build-isolation --no-index -e .
    if ! (cd /tmp && "$PY" -c "import tba, os, sys; sys.exit(tba.__file__.startswith('$PWD/') is False)"); then
        # pip could not install here (a read-only environment, no setuptools): use the tree
        # as it is; without a built engine `auto` picks posix (tba doctor says why)
        echo "== install: not importable from the checkout; using PYTHONPATH=$PWD" | tee -a "$LOG"
        export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    fi
    if [ -n "${KVIKIO_WHEELS:-}" ]; then
        run kvikio_install 60 "$PY" -m pip install --no-deps --no-index "$KVIKIO_WHEELS"/*.whl
    fi
    if [ -n "${TORCHTUNE_WHEELS:-}" ]; then  # torchtune and what its import needs (docs/gpu.md)
        run torchtune_install 60 "$PY" -m pip install --no-deps --no-index "$TORCHTUNE_WHEELS"/*.whl
    fi
    if ! "$PY" -c "import pytest" 2>/dev/null; then
        echo "== pytest does not import: carry its wheels (docs/gpu.md, Carrying wheels)" | tee -a "$LOG"
        printf '{"step": "pytest_missing", "rc": 1, "seconds": 0, "timed_out": false}\n' >>"$STEPS"
    fi
    # Most telling first, so that a short budget (BUDGET_S=540 fits one 10-minute device call
    # with its start) still yields the GPU tests, the main table and the overhead table; the
    # caps are what each step took on an H200 with room to spare (docs/gpu.md).
    run gpu_tests 150 "$PY" -m pytest -m gpu -rs -q -p no:cacheprovider tests
    run bench 180 "$PY" benchmarks/gpu/bench_gpu.py --profile tba,auto@0.5,recompute \
        --json "$OUT_DIR/bench.json"
    run overhead 90 "$PY" benchmarks/bench_overhead.py --device cuda --models launch,w1 --rounds 6
    run kvikio_mode 30 "$PY" -c "$KVIKIO_MODE" 0
    run kvikio_tests 60 "$PY" -m pytest -rs -q -p no:cacheprovider tests/storage/test_kvikio.py \
        tests/storage/test_kvikio_real.py
    if kvikio_imports; then
        run kvikio_bench 90 env TBA_BACKEND=kvikio "$PY" benchmarks/gpu/bench_gpu.py \
            --modes none,tba --warmup 1 --steps 3 --json "$OUT_DIR/kvikio_bench.json"
    fi
    # 16384 with fewer steps and modes (torchtune and selective left out): where the disk
    # matters. Its 150 s cap with every mode ran out on the H200 (2026-12-04)
    run bench_long 190 "$PY" benchmarks/gpu/bench_gpu.py --seq 16384 --warmup 2 --steps 3 \
        --modes none,checkpoint,save_on_cpu,tba,auto@0.5,auto@0.35,recompute \
        --json "$OUT_DIR/bench_long.json"
    run relay_bench 60 "$PY" benchmarks/gpu/bench_relay_gpu.py --json "$OUT_DIR/relay_bench.json"
    run doctor 30 "$PY" -m tba.cli doctor --json
    # The whole CPU suite, one line per test (-v: a suite cut short by the time limit still
    # names what failed so far) and failures again at the end (-rfE); spread over
    # pytest-xdist's workers when the image has it (the GPU image does). --dist load, not
    # loadfile: one file with 100+ slow tests on one worker made the suite outlast its time on
    # the GPU host. No test needs its file's tests on one worker: the module-scoped fixtures
    # (tests/sidecar) make their own temporary dirs and ports, one set per worker.
    XDIST=()
    if "$PY" -c "import xdist" 2>/dev/null; then
        n=$(( $(nproc) * 3 / 4 )); [ $n -gt 12 ] && n=12
        [ $n -ge 2 ] && XDIST=(-n "$n" --dist load -p no:benchmark)
    fi
    run cpu_suite "$BUDGET_S" "$PY" -m pytest -v -rfE -p no:cacheprovider "${XDIST[@]}" \
        -m "not gpu and not integration" --ignore=tests/integrations --ignore=tests/faults tests
fi
"$PY" benchmarks/gpu/summarize.py "$OUT_DIR" "$DRY" "$((SECONDS - START))"
rc=$?
if [ -f "$OUT_DIR/kvikio_mode.txt" ]; then  # GDS or compat mode, in the summary too
    grep '^kvikio backend:' "$OUT_DIR/kvikio_mode.txt" | cut -c1-300 | tee -a "$OUT_DIR/summary.txt"
fi
exit $rc
