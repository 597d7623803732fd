"""Gathers the GPU check's steps (benchmarks/gpu/check.sh) into check.json and summary.txt.

    python benchmarks/gpu/summarize.py OUT_DIR DRY SECONDS

Exit status 1 when a step failed or timed out, else 0.
"""

from __future__ import annotations

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


# A test's line under -v: "test_a.py::t PASSED [ 4%]", or with xdist "[gw3] [ 4%] PASSED
# test_a.py::t"
_VERBOSE = re.compile(
    r"^(?:(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b"
    r"|\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+))",
    re.M,
)


def pytest_result(text: str) -> dict:
    """Counts from pytest's closing line, each skip's reason (from -rs) and the failures (from
    -rfE). A run cut short has no closing line: then the counts and failures come from the
    one-line-per-test output of -v, and ``complete`` is False."""
    closing = re.findall(r"^(?:=+ )?(\d+ \w+(?:, \d+ \w+)*) in [\d.]+s", text, re.M)
    skips = re.findall(r"^SKIPPED \[(\d+)\] ([^:]+(?::\d+)?): (.*)$", text, re.M)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)
    if closing:
        found = re.findall(r"(\d+) (passed|failed|skipped|error|errors)", closing[-1])
        counts = {k: int(n) for n, k in found}
    else:
        counts, failed = {}, []
        for m in _VERBOSE.finditer(text):
            name, state = (m[1], m[2]) if m[1] else (m[4], m[3])
            key = {"ERROR": "error"}.get(state, state.lower())
            counts[key] = counts.get(key, 0) + 1
            if state in ("FAILED", "ERROR"):
                failed.append(name)
    return {
        "counts": counts,
        "complete": bool(closing),
        "skips": [{"n": int(n), "where": w, "why": why} for n, w, why in skips],
        "failed": failed,
    }


def targets_table(benches: list[tuple[str, dict]]) -> list[str]:
    """One table of issue 40's targets: a line per target, a column per benchmark run (its
    sequence length): pass, FAIL or n/a, and the figures it was judged on."""
    from bench_gpu import TARGETS, VERDICT

    heads = [f"seq {out['model']['seq']}" + (" (dry)" if out["dry"] else "") for _, out in benches]
    lines = ["targets (issue 40): " + " | ".join(heads)]
    for i, target in enumerate(TARGETS):
        cells = []
        for _, out in benches:
            got = out.get("acceptance", [])
            t = got[i] if i < len(got) and got[i]["target"] == target else None
            cells.append(
                "n/a  (not measured)" if t is None else f"{VERDICT[t['ok']]} {t['detail']}"
            )
        lines.append(f"  {target}")
        lines += [f"      {h}: {c}" for h, c in zip(heads, cells)]
    return lines


def read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def main() -> int:
    out_dir, dry, seconds = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
    steps = [json.loads(line) for line in read(os.path.join(out_dir, "steps.jsonl")).splitlines()]
    report: dict = {"dry": dry, "seconds": seconds, "steps": steps}
    for name in ("gpu_tests", "cpu_suite"):
        path = os.path.join(out_dir, f"{name}.txt")
        if os.path.exists(path):
            report[name] = pytest_result(read(path))
    for key in ("bench", "bench_long", "kvikio_bench", "relay_bench"):
        path = os.path.join(out_dir, f"{key}.json")
        if os.path.exists(path):
            report[key] = json.loads(read(path))
    overhead = os.path.join(out_dir, "overhead.txt")
    if os.path.exists(overhead):
        report["overhead"] = read(overhead)
    doctor = os.path.join(out_dir, "doctor.txt")
    if os.path.exists(doctor):
        try:
            report["doctor"] = json.loads(read(doctor))
        except ValueError:
            report["doctor"] = {"unparsed": read(doctor)[-2000:]}
    ok = all(s["rc"] == 0 for s in steps)
    report["ok"] = ok
    with open(os.path.join(out_dir, "check.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = [
        f"tba GPU check{' (dry run: no GPU used)' if dry else ''}: "
        f"{'PASS' if ok else 'FAIL'} in {seconds} s",
    ]
    for s in steps:
        if s.get("skipped"):
            state = "not run"
        elif s["rc"] == 0:
            state = "ok"
        else:
            state = "TIMED OUT" if s["timed_out"] else f"rc={s['rc']}"
        lines.append(f"  {s['step']:<17} {state:<10} {s['seconds']:>5} s")
    if any(s.get("skipped") for s in steps):
        lines.append("  (not run: too little of BUDGET_S was left to start the step)")
    for name in ("gpu_tests", "cpu_suite"):
        r = report.get(name)
        if r is None:
            continue
        counts = ", ".join(f"{n} {k}" for k, n in r["counts"].items())
        cut = "" if r["complete"] else " (cut short: counted from its -v lines)"
        lines.append(f"{name}: {counts or 'no result'}{cut}")
        lines += [f"  FAILED {f}" for f in r["failed"]]
        lines += [f"  skipped {s['n']} at {s['where']}: {s['why']}" for s in r["skips"]]
    benches = [(k, report[k]) for k in ("bench", "bench_long") if k in report]
    tables = benches + (
        [("kvikio_bench", report["kvikio_bench"])] if "kvikio_bench" in report else []
    )
    if tables:
        from bench_gpu import summary

        for key, out in tables:
            head = f"seq {out['model']['seq']}" if key != "kvikio_bench" else "TBA_BACKEND=kvikio"
            lines += [
                f"bench_gpu ({head}):",
                *("  " + ln for ln in summary(out, targets=False).splitlines()),
            ]
    if benches:
        lines += targets_table(benches)
    if "relay_bench" in report:
        from bench_relay_gpu import summary as relay_summary

        lines += [
            "bench_relay_gpu:",
            *("  " + ln for ln in relay_summary(report["relay_bench"]).splitlines()),
        ]
    if "overhead" in report:  # bench_overhead's tables as printed
        lines += ["bench_overhead:", *("  " + ln for ln in report["overhead"].splitlines() if ln)]
    doc = report.get("doctor")
    if isinstance(doc, dict) and "usable" in doc:
        backend = doc.get("backend")
        name = backend.get("name") if isinstance(backend, dict) else backend
        lines.append(f"tba doctor: usable={doc['usable']}, backend {name}")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        f.write(text)
    print(text, end="")
    print(f"written: {out_dir}/check.json, {out_dir}/summary.txt")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
