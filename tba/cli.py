"""The ``tba`` command: ``tba doctor``, ``tba bench``, ``tba plan`` and ``tba sidecar``.

Each subcommand is an ``_add_<name>`` function in ``SUBCOMMANDS`` that registers its parser and
sets ``run`` to a handler; the handler imports the module doing the work, so ``tba --help``
loads nothing else. ``import tba`` never imports this module. Exit codes: 0 success, 1 the
checked thing is unusable, 2 bad arguments or bad ``TBA_*`` settings.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from .config import (
    BACKENDS,
    parse_tbw,
    positive_number,
    seconds_between,
    size_at_least,
    whole_number,
)
from .errors import ValueParseError

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_UNUSABLE", "EXIT_USAGE"]

EXIT_OK = 0
EXIT_UNUSABLE = 1
EXIT_USAGE = 2

_DEFAULT_PROBE = "256MiB"
_MIN_PROBE = 1 << 20

T = TypeVar("T")


def _flag(parse: Callable[[str], T], name: str) -> Callable[[str], T]:
    """An argparse ``type=`` from one of tba.config's value parsers: a flag takes a value by
    the same rule as the ``TBA_*`` variable of its kind, and a bad one reads the same
    ("'x' is invalid; expected ..."), after the flag's name."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueParseError as e:
            msg = f"{e.value!r} is invalid; expected {e.expected}"
            raise argparse.ArgumentTypeError(msg) from None

    convert.__name__ = name  # argparse's fallback message names the type
    return convert


def _number(example: str) -> Callable[[str], float]:
    return _flag(positive_number(example), "number")


_COUNT = _flag(whole_number(1), "count")
_SIZE = _flag(size_at_least(1), "size")


def _dtype(text: str) -> int:
    from .plan import DTYPES

    if text.lower() in DTYPES:
        return DTYPES[text.lower()]
    raise ValueParseError(text, "one of fp32|bf16|fp16|fp8 (or float32, bfloat16, float16)")


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise ValueParseError(text, "a TCP port from 0 to 65535 (0 picks a free one)")
    return int(text)


def _interval_ms(text: str) -> float:
    try:
        ms = float(text)
    except ValueError:
        ms = float("nan")
    if not 0.1 <= ms <= 1000:
        raise ValueParseError(text, "milliseconds from 0.1 to 1000, such as 1")
    return ms


# -- tba doctor ------------------------------------------------------------------------------------
def _add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this node's spill dir, I/O engines and GPU; recommend TBA_* settings",
        description=(
            "Check that tba can spill on this node: O_DIRECT and alignment, io_uring, the "
            "native engine, memlock, kvikio/GDS, CUDA, free space and filesystem type, the "
            "backend auto picks, and the write/read throughput through it. Prints the TBA_* "
            "settings it recommends. Exit 0: usable (warnings allowed); 1: the spill dir is "
            "unusable; 2: bad arguments or TBA_* settings. Leaves nothing on disk."
        ),
    )
    p.add_argument(
        "--spill-dir",
        metavar="DIR",
        help="directory to check (default: TBA_SPILL_DIR, else /var/tmp/tba-<uid>)",
    )
    p.add_argument(
        "--probe-bytes",
        metavar="N",
        type=_flag(size_at_least(_MIN_PROBE), "size"),
        default=_DEFAULT_PROBE,
        help=f"bytes written and read to measure throughput, e.g. 64MiB (default {_DEFAULT_PROBE})",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        help="backend to measure (default: TBA_BACKEND, else auto)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=_run_doctor)


def _run_doctor(args: argparse.Namespace) -> int:
    from . import doctor
    from .errors import ConfigError

    try:
        report = doctor.run(
            spill_dir=args.spill_dir, probe_bytes=args.probe_bytes, backend=args.backend
        )
    except ConfigError as e:
        print(f"tba doctor: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(doctor.render_json(report) if args.json else doctor.render_table(report))
    return report.exit_code


# -- tba bench -------------------------------------------------------------------------------------
def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="memory timeline of one training step, with and without tba (--plot, --csv)",
        description=(
            "Run a few forward+backward steps of the test GPT (W1 by default) without and with "
            "tba, record the bytes of saved tensors resident during the last step of each, "
            "print a summary, and optionally draw both curves (--plot, needs matplotlib: "
            "pip install 'tba[plot]') or write them as CSV (--csv). tba's settings come from "
            "the TBA_* variables, as everywhere. Exit 0: done; 2: bad arguments or settings, "
            "or --plot without matplotlib."
        ),
    )
    p.add_argument("--layers", type=_COUNT, default=6, help="blocks (W1: 6)")
    p.add_argument("--hidden", type=_COUNT, default=512, help="hidden size (W1: 512)")
    p.add_argument("--heads", type=_COUNT, default=8, help="attention heads (W1: 8)")
    p.add_argument("--seq", type=_COUNT, default=512, help="sequence length (W1: 512)")
    p.add_argument("--batch", type=_COUNT, default=8, help="micro-batch (W1: 8)")
    p.add_argument(
        "--steps",
        type=_COUNT,
        default=2,
        help="steps per mode; the last one is recorded (default 2: one warm-up)",
    )
    p.add_argument(
        "--interval-ms",
        type=_flag(_interval_ms, "milliseconds"),
        default=1.0,
        metavar="MS",
        help="sampling period for tba's resident bytes and RSS (default 1 ms)",
    )
    p.add_argument(
        "--rss",
        action="store_true",
        help="also sample and plot the process RSS (each mode then runs in a fresh process)",
    )
    p.add_argument(
        "--spill-dir",
        metavar="DIR",
        help="tba's spill dir (default: TBA_SPILL_DIR, else /var/tmp/tba-<uid>)",
    )
    p.add_argument("--plot", metavar="PNG", help="draw both curves into this image file")
    p.add_argument("--csv", metavar="CSV", help="write the samples (mode,kind,seconds,bytes)")
    p.set_defaults(run=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from . import bench
    from .config import Config
    from .errors import ConfigError

    if args.hidden % args.heads:
        print(
            f"tba bench: --hidden {args.hidden} is not a multiple of --heads {args.heads}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.plot:
        try:
            bench.require_matplotlib()
        except bench.PlotUnavailable as e:
            print(f"tba bench: {e}", file=sys.stderr)
            return EXIT_USAGE
    settings = bench.BenchSettings(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        seq=args.seq,
        batch=args.batch,
        steps=args.steps,
        interval=args.interval_ms / 1000,
        rss=args.rss,
        spill_dir=args.spill_dir,
    )
    try:
        config = Config(spill_dir=args.spill_dir) if args.spill_dir else Config()
    except ConfigError as e:
        print(f"tba bench: {e}", file=sys.stderr)
        return EXIT_USAGE
    if not config.enabled:
        print("tba bench: TBA_ENABLED=0; nothing to compare", file=sys.stderr)
        return EXIT_USAGE
    traces = bench.run(settings, config, progress=lambda m: print(f"tba bench: {m}", flush=True))
    print(bench.summary(traces, settings))
    if args.csv:
        bench.write_csv(traces, args.csv)
        print(f"wrote {args.csv}")
    if args.plot:
        bench.plot(traces, settings, args.plot)
        print(f"wrote {args.plot}")
    return EXIT_OK


# -- tba plan --------------------------------------------------------------------------------------
def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="predict whether the SSDs keep up: bytes, bandwidth, step time and peak per keep-K",
        description=(
            "Predict tba's schedule before buying hardware: activation bytes per layer, the "
            "bandwidth that hides offload behind compute, and a simulated step time, stall and "
            "peak memory for every TBA_KEEP_LAST, with the recommended K and keep-all vs "
            "offload vs recompute. From a model shape and hardware figures, or from a trace "
            "(TBA_TRACE) of a real run. Model and rules: tba/plan/ and tba/decide/simulator/. "
            "Exit 0: done; 2: bad input."
        ),
    )
    m = p.add_argument_group("model shape")
    m.add_argument("--layers", type=_COUNT, metavar="N", help="transformer layers")
    m.add_argument("--hidden", type=_COUNT, metavar="H", help="hidden size")
    m.add_argument("--heads", type=_COUNT, metavar="A", help="attention heads")
    m.add_argument("--kv-heads", type=_COUNT, metavar="N", help="key/value heads (default: heads)")
    m.add_argument("--seq", type=_COUNT, metavar="S", help="sequence length")
    m.add_argument("--batch", type=_COUNT, metavar="B", help="micro-batch (default 1)")
    m.add_argument("--dtype", type=_flag(_dtype, "dtype"), help="fp32|bf16|fp16|fp8 (default bf16)")
    m.add_argument("--tp", type=_COUNT, metavar="T", help="tensor-parallel degree (default 1)")
    m.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallel")
    m.add_argument("--attention", choices=("flash", "explicit"), help="default flash")
    m.add_argument("--arch", choices=("gpt", "llama"), help="gpt: LN+GELU; llama: RMSNorm+SwiGLU")
    m.add_argument(
        "--mlp-ratio",
        type=_number("4"),
        metavar="R",
        help="MLP width/hidden",
    )
    m.add_argument("--vocab", type=_flag(whole_number(0), "count"), help="vocabulary (0: no head)")
    m.add_argument("--dropout", action="store_true", help="dropout masks are saved")
    h = p.add_argument_group("hardware")
    h.add_argument("--flops", type=_number("400e12"), help="achieved FLOP/s per GPU")
    h.add_argument(
        "--layer-fwd-ms",
        type=_number("4.8"),
        metavar="MS",
        help="forward ms per layer",
    )
    h.add_argument(
        "--backward-ratio",
        type=_number("2"),
        metavar="X",
        help="backward/forward (2)",
    )
    h.add_argument("--write-gbps", type=_number("6"), metavar="GB/S", help="per drive")
    h.add_argument("--read-gbps", type=_number("6"), metavar="GB/S", help="per drive")
    h.add_argument("--drives", type=_COUNT, metavar="N", help="drives striped together (default 1)")
    h.add_argument(
        "--duplex",
        choices=("full", "shared"),
        help="full: reads and writes run at once (NVMe, default); shared: one queue (virtio)",
    )
    h.add_argument("--device", choices=("cuda", "cpu"), help="where activations live (cuda)")
    h.add_argument(
        "--capture-gbps",
        type=_number("10"),
        metavar="GB/S",
        help="capture copy on the compute thread (a CPU memcpy, as with TBA_CHECKSUM on; unset: "
        "overlapped, or none: CPU tensors are written from their own memory)",
    )
    h.add_argument(
        "--h2d-gbps",
        type=_number("50"),
        metavar="GB/S",
        help="read-back host-to-device copy on the compute stream (unset: overlapped)",
    )
    h.add_argument(
        "--device-mem",
        type=_SIZE,
        metavar="SIZE",
        help="memory for activations",
    )
    h.add_argument(
        "--host-mem",
        type=_SIZE,
        metavar="SIZE",
        help="host memory for tba",
    )
    h.add_argument(
        "--host-tier",
        type=_SIZE,
        metavar="SIZE",
        help="pinned host memory in front of the disk (TBA_HOST_BYTES of one rank); the plan "
        "then also shows the same plan without it",
    )
    h.add_argument(
        "--host-tier-gbps",
        type=_number("50"),
        metavar="GB/S",
        help="the host tier's copy rate each way (PCIe or memcpy; unset: instant)",
    )
    k = p.add_argument_group("tba settings (default: tba's, or the trace's)")
    k.add_argument(
        "--prefetch",
        type=_SIZE,
        metavar="SIZE",
        help="TBA_PREFETCH_BYTES",
    )
    k.add_argument("--staging", type=_SIZE, metavar="SIZE", help="TBA_STAGING_BYTES")
    k.add_argument(
        "--min-offload",
        type=_SIZE,
        metavar="SIZE",
        help="TBA_MIN_OFFLOAD_BYTES",
    )
    k.add_argument(
        "--budget",
        metavar="SIZE|FRACTION",
        help="TBA_MEMORY_BUDGET for the mix: a size, or a share of the step's saved bytes "
        "(default: --device-mem, else 0.35)",
    )
    o = p.add_argument_group("mode")
    o.add_argument("--trace", metavar="FILE", help="a TBA_TRACE file of a real run")
    o.add_argument(
        "--steps",
        type=_COUNT,
        help="steps simulated back to back, the last shown (default: until steady)",
    )
    o.add_argument("--projections", action="store_true", help="the 7B Llama on H100 tables")
    o.add_argument(
        "--projections-mix",
        action="store_true",
        help="the chooser's mix for the 7B Llama on H100 with 1, 2 and 4 drives (minutes)",
    )
    o.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from . import plan

    return plan.run_cli(args)


# -- tba sidecar -----------------------------------------------------------------------------------
def _add_sidecar(sub: argparse._SubParsersAction) -> None:
    from .sidecar.settings import DEFAULT_PORT

    p = sub.add_parser(
        "sidecar",
        help="one per node: serve every rank's metrics (/metrics, /healthz, /status), janitor",
        description=(
            "Serve the metrics every tba process on this node writes into TBA_METRICS_DIR, "
            "merged, plus node gauges (spill filesystems, SSD endurance, janitor), on "
            "/metrics; /healthz and /status (JSON) too. Every --interval it scans the spill "
            "roots and /sys and reclaims what dead ranks left behind (their live-gauge files and "
            "empty spill directories). Logs are JSON lines on stderr; SIGTERM stops it cleanly. "
            "Exit 0: stopped; 2: bad arguments or settings (the message names the fix)."
        ),
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; 0.0.0.0 for a scrape from another host)",
    )
    p.add_argument(
        "--port",
        type=_flag(_port, "port"),
        default=DEFAULT_PORT,
        help=f"TCP port (default {DEFAULT_PORT}; 0 picks a free one and logs it)",
    )
    p.add_argument(
        "--metrics-dir",
        metavar="DIR",
        help="the ranks' TBA_METRICS_DIR (default: TBA_METRICS_DIR); it must exist",
    )
    p.add_argument(
        "--spill-dir",
        metavar="DIR",
        action="append",
        help="a spill root to watch and clean; repeat for several (default: TBA_SPILL_DIR)",
    )
    p.add_argument(
        "--interval",
        type=_flag(seconds_between(0.1, 3600, "10"), "seconds"),
        default=10.0,
        metavar="SECONDS",
        help="seconds between scans and janitor passes (default 10)",
    )
    p.add_argument(
        "--rate-window",
        type=_flag(seconds_between(1, 7 * 86400, "3600"), "seconds"),
        default=3600.0,
        metavar="SECONDS",
        help="span of the write-rate samples behind the endurance figures (default 3600)",
    )
    p.add_argument(
        "--ssd-tbw",
        type=_flag(parse_tbw, "tbw"),
        metavar="TB",
        help="rated endurance of each spill drive in TB written (default: TBA_SSD_TBW)",
    )
    p.add_argument(
        "--no-janitor",
        action="store_true",
        help="remove nothing; only report (the metrics dir may then be read-only)",
    )
    p.add_argument(
        "--log-level",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        type=str.upper,
        default="INFO",
        help="level of the JSON log on stderr (default INFO)",
    )
    p.set_defaults(run=_run_sidecar, parser=p)


def _run_sidecar(args: argparse.Namespace) -> int:
    import asyncio

    from .config import Config
    from .errors import ConfigError
    from .sidecar import Settings, Sidecar, SidecarError
    from .sidecar.jsonlog import install

    def usage(msg: str) -> int:
        args.parser.print_usage(sys.stderr)
        print(f"tba sidecar: error: {msg}", file=sys.stderr)
        return EXIT_USAGE

    try:
        config = Config()
    except ConfigError as e:
        return usage(str(e))
    metrics_dir = args.metrics_dir or config.metrics_dir
    if not metrics_dir:
        return usage(
            "no metrics directory: pass --metrics-dir DIR or set TBA_METRICS_DIR, the directory "
            "the training processes write their metrics into"
        )
    if args.rate_window < 2 * args.interval:
        return usage(
            f"--rate-window {args.rate_window:g} is shorter than two --interval periods "
            f"({2 * args.interval:g} s): a rate needs at least two samples"
        )
    settings = Settings(
        metrics_dir=metrics_dir,
        spill_roots=tuple(args.spill_dir or [config.spill_dir]),
        host=args.host,
        port=args.port,
        interval=args.interval,
        ssd_tbw=args.ssd_tbw if args.ssd_tbw is not None else config.ssd_tbw,
        rate_window=args.rate_window,
        janitor=not args.no_janitor,
    )
    try:
        sidecar = Sidecar(settings)  # checks the metrics dir
    except SidecarError as e:
        return usage(str(e))
    install(args.log_level)
    try:
        return asyncio.run(sidecar.run())
    except SidecarError as e:  # e.g. the port is taken
        return usage(str(e))


SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_doctor,
    _add_bench,
    _add_plan,
    _add_sidecar,
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tba", description="tba: activation offload to local SSD.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tba`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on a usage error, 0 after --help
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("tba: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
