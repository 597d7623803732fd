"""The typed error of :mod:`tba.relay` whose message names the relay as its component."""

from __future__ import annotations

from ..errors import ConfigError

__all__ = ["RelayConfigError", "describe"]


class RelayConfigError(ConfigError):
    """A relay option, a layer list or a batch that the relay cannot use.

    A :class:`tba.ConfigError` (and so a ``ValueError``); only the message's component differs:
    ``tba.relay: what happened, the numbers. The fix.``
    """

    def __init__(self, problems: list[str] | str):
        super().__init__(problems)
        if len(self.problems) == 1:
            msg = f"tba.relay: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            msg = f"tba.relay: {len(self.problems)} problems:\n{lines}"
        self.args = (msg,)


def describe(obj: object) -> str:
    """What a callback returned, for a message: "a tensor of shape (2, 3)", "a tuple"."""
    shape = getattr(obj, "shape", None)
    if shape is not None and hasattr(obj, "dtype"):
        return f"a tensor of shape {tuple(shape)}"
    return f"a {type(obj).__name__}"
