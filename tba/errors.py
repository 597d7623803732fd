"""Typed errors. Each also inherits the built-in type a caller would naturally catch.

Every message follows one shape: ``tba.<component>: what happened, the numbers. The fix.``
"""

from __future__ import annotations

import errno as _errno
import os


class TBAError(Exception):
    """Base class of every error tba raises on purpose."""


class ConfigError(TBAError, ValueError):
    """One or more configuration values are invalid. ``problems`` lists each one."""

    def __init__(self, problems: list[str] | str):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        if len(self.problems) == 1:
            msg = f"tba.config: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            msg = f"tba.config: {len(self.problems)} problems:\n{lines}"
        super().__init__(msg)


class ValueParseError(ConfigError):
    """One value cannot be parsed (a size, a count, a choice ...). ``expected`` says what is
    accepted; :class:`tba.Config` folds it into its own list of problems, naming the variable."""

    def __init__(self, value: object, expected: str):
        self.value = value
        self.expected = expected
        super().__init__(f"{value!r} is invalid; expected {expected}.")


class StorageError(TBAError, OSError):
    """An I/O operation on a spill file failed. Carries the file, offset, byte count and errno."""

    def __init__(
        self,
        op: str,
        path: str,
        offset: int,
        nbytes: int,
        err: int,
        hint: str = "",
    ):
        self.op = op
        self.path = path
        self.offset = offset
        self.nbytes = nbytes
        name = _errno.errorcode.get(err, str(err))
        text = f"tba.storage: {op} of {nbytes} bytes at offset {offset} in {path} failed: "
        text += f"{name} ({os.strerror(err)})."
        if hint:
            text += f" {hint}"
        OSError.__init__(self, err, text)
        self.filename = path

    def __str__(self) -> str:  # OSError's default adds "[Errno n]"; ours already names it
        return self.strerror or ""

    def __reduce__(self):
        return (StorageError, (self.op, self.path, self.offset, self.nbytes, self.errno))


class CapacityError(TBAError, RuntimeError):
    """A bounded resource (staging, disk quota) cannot hold a request and keeping is off."""


class UsageError(TBAError, RuntimeError):
    """The API was used in an order it does not support (nested steps, a closed Offloader)."""


class UnpackError(TBAError, RuntimeError):
    """A saved tensor cannot be given back to autograd exactly (e.g. it was modified in place)."""


def hint_for(err: int) -> str:
    """The fix we suggest for an errno met on a spill file."""
    if err in (_errno.ENOSPC, _errno.EDQUOT):
        return "Free space on the spill filesystem, or lower TBA_MAX_DISK_BYTES."
    if err == _errno.EINVAL:
        return "The filesystem may refuse O_DIRECT: try TBA_BACKEND=buffered."
    if err in (_errno.EIO, _errno.ENXIO, _errno.ENODEV):
        return "The device reported an I/O error: check dmesg and the drive's health."
    if err in (_errno.EACCES, _errno.EPERM):
        return "Check the permissions of TBA_SPILL_DIR."
    if err == _errno.EROFS:
        return "The spill filesystem is read-only: remount it read-write, or move TBA_SPILL_DIR."
    if err in (_errno.ENOENT, _errno.ENOTDIR, _errno.ESTALE):
        return (
            "The spill directory was removed while tba ran: do not clean TBA_SPILL_DIR under a "
            "running job (tba removes what it made at exit); tba keeps tensors in memory."
        )
    return ""


class InternalError(TBAError, RuntimeError):
    """An invariant of tba itself does not hold: a bug in tba, not in the caller's code."""


def internal_error(component: str, what: str) -> InternalError:
    """The error for a broken invariant, worded so the user knows to report it."""
    return InternalError(
        f"tba.{component}: {what}. This is a bug in tba, not in your code: please report it "
        "with this traceback and the output of `tba doctor`."
    )


def modified_error(
    shape: object, dtype: object, now: int, then: int, what: str = "saved tensor"
) -> UnpackError:
    """Stock PyTorch's in-place error, for a saved tensor modified after it was packed (a
    parameter or leaf passed through: ``what="saved parameter or leaf"``), or for the parameter
    a weight-derived tensor is recomputed from (``what="parameter"``,
    NOTE [Weight-derived tensors] in tba/datapath/capture/derived.py)."""
    if what == "parameter":
        fix = (
            "A saved cast of this parameter is recomputed from it in backward, as autograd "
            "reads a parameter it saved: modify parameters after backward (optimizer.step()), "
            "or set TBA_RECOMPUTE_WEIGHTS=0 where a framework rewrites them in between."
        )
    elif what.startswith("saved parameter"):
        fix = (
            "Stock PyTorch raises here too: change parameters after backward (optimizer.step() "
            "after loss.backward()), or clone the tensor before modifying it."
        )
    else:
        fix = (
            "Stock PyTorch raises here too: clone the tensor before modifying it, or use the "
            "out-of-place operation."
        )
    return UnpackError(
        f"tba.unpack: one of the variables needed for gradient computation has been modified "
        f"by an inplace operation: a {what} of shape {list(shape)} and dtype {dtype} is "
        f"at version {now}; expected version {then} instead. {fix}"
    )
