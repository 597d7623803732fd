"""The dedup index, the graveyard of dead handles, and the resident-byte count.

No files, no streams, no owner: what happens when an entry's last handle dies, and where the
resident peak is recorded, are callables given at construction.

# NOTE [Storage identity]
The dedup key uses the StorageImpl address. While an entry exists it holds a weak reference to
that storage (:class:`tba.records.step.StorageRef`), which keeps the StorageImpl object itself
allocated, so a new storage can never be created at the same address and alias an old entry;
the data memory is still freed normally.

# NOTE [Deferred release]
A handle's ``__del__`` can run anywhere: after a backward node, but also inside cyclic GC
triggered by any allocation, on any thread, possibly while that thread holds the staging or
slab lock. So ``__del__`` only appends to ``graveyard`` (an atomic deque append) and the owner
of the lock calls :meth:`Index.bury` at safe points (pack, unpack, step edges, stats,
synchronize, I/O completions) with its lock held and no other tba lock taken.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from ..errors import internal_error
from .entry import Entry
from .handle import Credit, Handle, KeptEntry


class Index:
    """Which views and storages are already saved, and how many bytes tba holds in memory.

    ``on_resident(bytes)`` runs after every increase of :attr:`resident`. :attr:`on_dead`
    (``entry -> None``) runs from :meth:`bury` when an entry's last handle has died: whoever
    frees entries sets it (the Offloader wires it to ``Reader.retire``). The caller holds its
    lock around every method.
    """

    def __init__(self, on_resident: Callable[[int], None] = lambda n: None):
        self.on_dead: Callable[[Entry], None] = _unwired
        self.on_resident = on_resident
        self.handles: dict[Any, weakref.ref] = {}  # view key -> handle
        self.entries: dict[Any, Entry] = {}  # (storage cdata, version) -> whole-storage entry
        self.kept: dict[int, KeptEntry] = {}  # storage cdata -> kept storage
        self.captured: dict[int, int] = {}  # storage cdata -> its entries not yet dead
        self.resident = 0
        self.graveyard: deque = deque()  # (key, entry, packs) of dead handles; see bury()

    # -- accounting ---------------------------------------------------------------------------
    def charge(self, n: int) -> None:
        self.resident += n
        self.on_resident(self.resident)

    def uncharge(self, n: int) -> None:
        self.resident -= n

    # -- lookups ------------------------------------------------------------------------------
    def find(self, key: Any) -> Handle | None:
        ref = self.handles.get(key)
        return None if ref is None else ref()

    def add_handle(self, h: Handle) -> None:
        self.handles[h.key] = weakref.ref(h)

    def kept_entry(self, storage: Any, cdata: int, nbytes: int) -> KeptEntry:
        """The record of a kept storage (charged once, however many views keep it)."""
        e = self.kept.get(cdata)
        if e is None:
            e = self.kept[cdata] = KeptEntry(storage, self.graveyard, cdata, nbytes)
            self.charge(nbytes)
        return e

    def add_entry(self, e: Entry) -> None:
        """Count a new entry against its storage (the pack hook's fast path leaves a storage
        with a captured entry to the dedup lookup, NOTE [Hot path] in tba/datapath/pack.py)."""
        cdata = e.key[0]
        self.captured[cdata] = self.captured.get(cdata, 0) + 1

    # -- lifetimes (NOTE [Deferred release]) --------------------------------------------------
    def bury(self) -> None:
        """Account every handle that died since the last call. Lock held."""
        g = self.graveyard
        while g:
            key, e, packs = g.popleft()
            if type(e) is KeptEntry:
                e.handles -= 1
                if e.handles == 0:
                    if self.kept.get(e.sid) is e:
                        del self.kept[e.sid]
                    self.uncharge(e.nbytes)
                continue
            if type(e) is Credit:  # a block run without tba's hooks has been through backward
                self.uncharge(e.nbytes)
                continue
            ref = self.handles.get(key)
            if ref is not None and ref() is None:
                del self.handles[key]
            if e.forget(packs):
                if self.entries.get(e.key) is e:
                    del self.entries[e.key]
                cdata = e.key[0]
                n = self.captured.get(cdata, 0) - 1
                if n > 0:
                    self.captured[cdata] = n
                else:
                    self.captured.pop(cdata, None)
                self.on_dead(e)


def _unwired(e: Entry) -> None:
    raise internal_error("index", f"{e!r} died but nothing was wired to free it (on_dead)")
