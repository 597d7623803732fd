"""Which tensors' bytes an Offloader wrote: a content scan of every buffer its backend writes,
independent of how tba decided what to write (tests of NOTE [Weight-derived tensors])."""

from __future__ import annotations

import torch

import tba


class WriteScanner:
    """Counts which of ``tensors`` had their bytes written: wraps the Offloader's backend
    ``write`` and looks in every buffer for each tensor's bytes. A tensor's bytes start on a
    64-byte boundary of the buffer (a staging block, a coalesced slot, or the tensor's own
    page, all 64-byte aligned), so candidates are found by their first 8 bytes there."""

    def __init__(self, off: tba.Offloader, tensors: list[torch.Tensor]):
        self.raw = [t.detach().contiguous().view(torch.uint8).flatten() for t in tensors]
        self.first = torch.stack([r[:8].view(torch.int64)[0] for r in self.raw])
        self.found: set[int] = set()
        self.writes = 0
        real = off.backend.write

        def write(extent, buf, *args, **kwargs):
            self.scan(buf)
            return real(extent, buf, *args, **kwargs)

        off.backend.write = write

    def scan(self, buf) -> None:
        self.writes += 1
        b = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0)
        rows = b[: len(b) // 64 * 64].view(torch.int64).view(-1, 8)[:, 0]
        for r in torch.isin(rows, self.first).nonzero().flatten().tolist():
            for i in (self.first == rows[r]).nonzero().flatten().tolist():
                raw, at = self.raw[i], r * 64
                if len(b) - at >= len(raw) and torch.equal(b[at : at + len(raw)], raw):
                    self.found.add(i)
