"""What `tba plan` is given besides the model: the hardware, tba's settings, the input error."""

from __future__ import annotations

import dataclasses
import math

from ..decide.simulator import Setup

GB = 1e9
ALIGN = 4096  # tba's extents and staging blocks are aligned to this
DTYPES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}


class PlanInputError(ValueError):
    """Bad planner input; ``flag`` names the command-line flag, the text says what is accepted."""

    def __init__(self, flag: str, message: str):
        self.flag = flag
        super().__init__(f"{flag}: {message}")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Rates in bytes/s (None: infinite or not on the critical path)."""

    write_bps: float | None
    read_bps: float | None
    drives: int = 1  # rates are per drive; tba's spill dir striped over them (RAID0)
    duplex: str = "full"  # "shared": reads and writes queue on one server
    flops: float | None = None  # achieved FLOP/s (model FLOPs)
    layer_fwd_seconds: float | None = None  # measured forward time of one layer instead
    backward_ratio: float = 2.0
    device: str = "cuda"  # "cpu": memory is one pool, capture is a memcpy on the compute thread
    capture_bps: float | None = None  # capture copy on the compute timeline (CPU memcpy)
    h2d_bps: float | None = None  # read-back H2D copy on the compute timeline (CUDA, staged)
    device_bytes: int | None = None  # memory left for activations on the device
    host_bytes: int | None = None
    # the host tier (NOTE [Host tier] in tba/storage/hosttier.py): its capacity (None: none)
    # and the rate of its copies each way (None: instant; PCIe or a memcpy in practice)
    host_tier_bytes: int | None = None
    host_tier_bps: float | None = None

    def __post_init__(self) -> None:
        if self.duplex not in ("full", "shared"):
            raise PlanInputError("--duplex", "one of full|shared")
        if self.drives < 1:
            raise PlanInputError("--drives", "must be 1 or more")
        if self.device not in ("cuda", "cpu"):
            raise PlanInputError("--device", "one of cuda|cpu")
        for flag, v in (
            ("--write-gbps", self.write_bps),
            ("--read-gbps", self.read_bps),
            ("--flops", self.flops),
            ("--layer-fwd-ms", self.layer_fwd_seconds),
            ("--backward-ratio", self.backward_ratio),
            ("--host-tier-gbps", self.host_tier_bps),
        ):
            if v is not None and not v > 0:
                raise PlanInputError(flag, "must be above 0")

    @property
    def write_rate(self) -> float:
        return math.inf if self.write_bps is None else self.write_bps * self.drives

    @property
    def read_rate(self) -> float:
        return math.inf if self.read_bps is None else self.read_bps * self.drives

    def scaled(self, factor: float) -> Hardware:
        """The same machine with both disk rates (per drive) multiplied by ``factor``."""
        w = None if self.write_bps is None else self.write_bps * factor
        r = None if self.read_bps is None else self.read_bps * factor
        return dataclasses.replace(self, write_bps=w, read_bps=r)


@dataclasses.dataclass(frozen=True)
class Knobs:
    """tba's settings that shape the schedule (TBA_PREFETCH_BYTES, TBA_STAGING_BYTES, ...)."""

    prefetch_bytes: int = 128 << 20
    staging_bytes: int = 256 << 20
    min_offload_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if self.prefetch_bytes < 1:
            raise PlanInputError("--prefetch", "a size of at least 1 byte, such as 128MiB")
        if self.staging_bytes < 1:
            raise PlanInputError("--staging", "a size of at least 1 byte, such as 256MiB")


def setup_for(hw: Hardware, knobs: Knobs) -> Setup:
    """The simulator's setup for this machine and these settings (NOTE [Simulator] in
    tba/decide/simulator/engine.py): every rate and limit as given, tba's extent alignment, and the
    read-ahead window tba's DepthController would size within ``prefetch_bytes``."""
    return Setup(
        write_bps=hw.write_rate,
        read_bps=hw.read_rate,
        shared_disk=hw.duplex == "shared",
        capture_bps=hw.capture_bps or math.inf,
        h2d_bps=hw.h2d_bps or math.inf,
        staging_bytes=knobs.staging_bytes,
        min_offload_bytes=knobs.min_offload_bytes,
        prefetch_bytes=knobs.prefetch_bytes,
        size_window=True,
        align=ALIGN,
        host_bytes=hw.host_tier_bytes or 0,
        host_bps=hw.host_tier_bps or math.inf,
    )
