"""The report as a table or as JSON."""

from __future__ import annotations

import json
import textwrap

from .. import __version__
from ..config import format_size
from .report import STATUSES, Report

TABLE_WIDTH = 100


def render_table(rep: Report, width: int = TABLE_WIDTH) -> str:
    """The report as a table (check, status, detail), the export lines and a verdict."""
    label_w = max(len(c.label) for c in rep.checks.values())
    status_w = max(len("status"), *(len(s) for s in STATUSES))
    indent = label_w + status_w + 4
    lines = [
        f"tba doctor {__version__}: spill dir {rep.facts['spill_dir']['root']}, probe "
        f"{format_size(rep.facts['probe_bytes'])}, {rep.elapsed:.1f} s",
        "",
        f"{'check':<{label_w}}  {'status':<{status_w}}  detail",
    ]
    for c in rep.checks.values():
        wrapped = textwrap.wrap(
            c.detail, max(40, width - indent), break_long_words=False, break_on_hyphens=False
        ) or [""]
        lines.append(f"{c.label:<{label_w}}  {c.status:<{status_w}}  {wrapped[0]}")
        lines.extend(" " * indent + more for more in wrapped[1:])
    lines += ["", "recommended settings (rules: tba/doctor/recommend.py):"]
    exports = [r for r in rep.recommendations if r.value is not None]
    pad = max((len(r.line) for r in exports), default=0)
    for r in rep.recommendations:
        lines.append(f"{r.line:<{pad}}  # {r.reason}" if r.value is not None else r.line)
    lines.append("")
    warn = sum(c.status == "warn" for c in rep.checks.values())
    if rep.exit_code:
        lines.append(f"result: UNUSABLE: {rep.problem}")
    else:
        lines.append(f"result: usable ({warn} warning{'' if warn == 1 else 's'})")
    return "\n".join(lines)


def render_json(rep: Report) -> str:
    return json.dumps(rep.as_json(), indent=2)
