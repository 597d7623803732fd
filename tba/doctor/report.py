"""What a ``tba doctor`` run produces: rows (:class:`Check`), advice (:class:`Recommendation`)
and the :class:`Report` that holds them with the facts (NOTE [Doctor] in tba/doctor/__init__.py).
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any

from .. import __version__

GIB = 1 << 30
MIB = 1 << 20
DEFAULT_PROBE_BYTES = 256 * MIB
MIN_PROBE_BYTES = MIB
EXTENT_BYTES = 16 * MIB
SWEEP = (1, 2, 4, 8)  # requests in flight for the read passes; also the most buffers we hold

STATUSES = ("ok", "warn", "FAIL", "skip")

# (key, label) of every row, in table order. JSON uses the keys.
ROWS = (
    ("config", "config"),
    ("spill_dir", "spill dir"),
    ("filesystem", "filesystem"),
    ("free_space", "free space"),
    ("o_direct", "O_DIRECT"),
    ("io_uring", "io_uring"),
    ("native_engine", "native engine"),
    ("memlock", "memlock"),
    ("host_malloc", "host malloc"),
    ("kvikio", "kvikio/GDS"),
    ("cuda", "CUDA"),
    ("backend", "backend"),
    ("write", "write"),
    ("read", "read"),
    ("cleanup", "cleanup"),
)


# -- results -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Check:
    key: str
    label: str
    status: str
    detail: str


@dataclasses.dataclass
class Recommendation:
    env: str
    value: str | None  # None: advice only, printed as a comment, nothing to export
    reason: str

    @property
    def line(self) -> str:
        if self.value is None:
            return f"# {self.env}: {self.reason}"
        return f"export {self.env}={shlex.quote(self.value)}"


@dataclasses.dataclass
class Report:
    checks: dict[str, Check]
    facts: dict[str, Any]
    recommendations: list[Recommendation]
    elapsed: float = 0.0

    @property
    def exit_code(self) -> int:
        return 1 if any(c.status == "FAIL" for c in self.checks.values()) else 0

    @property
    def problem(self) -> str | None:
        """The first failed check, as ``label: detail``; None when the spill dir is usable."""
        for c in self.checks.values():
            if c.status == "FAIL":
                return f"{c.label}: {c.detail}"
        return None

    def as_json(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "usable": self.exit_code == 0,
            "exit_code": self.exit_code,
            "problem": self.problem,
            "elapsed_seconds": round(self.elapsed, 3),
            "checks": {k: {"status": c.status, "detail": c.detail} for k, c in self.checks.items()},
            **self.facts,
            "recommendations": [
                {
                    "env": r.env,
                    "value": r.value,
                    "reason": r.reason,
                    "export": r.line if r.value is not None else None,
                }
                for r in self.recommendations
            ],
        }
