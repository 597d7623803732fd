"""The ``tba`` command: ``tba doctor`` (more subcommands, such as ``plan``, ``bench`` and
``sidecar``, plug in the same way).

Each subcommand is an ``_add_<name>`` function in ``SUBCOMMANDS`` that registers its parser and
sets ``run`` to a handler; the handler imports the module doing the work, so ``tba --help``
loads nothing else. ``import tba`` never imports this module. Exit codes: 0 success, 1 the
checked thing is unusable, 2 bad arguments or bad ``TBA_*`` settings.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from .config import BACKENDS, format_size, parse_size

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_UNUSABLE", "EXIT_USAGE"]

EXIT_OK = 0
EXIT_UNUSABLE = 1
EXIT_USAGE = 2

_DEFAULT_PROBE = "256MiB"
_MIN_PROBE = 1 << 20


def _probe_size(text: str) -> int:
    try:
        n = parse_size(text)
    except Exception:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; use e.g. 64MiB, 256MiB or 1GiB"
        ) from None
    if n < _MIN_PROBE:
        raise argparse.ArgumentTypeError(
            f"{text!r} is below the minimum, {format_size(_MIN_PROBE)}"
        )
    return n


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
        type=_probe_size,
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


SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_doctor,)


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
