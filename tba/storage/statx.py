"""Filesystem facts the storage layer needs: direct-I/O alignment (statx) and filesystem type.

Both go through ``ctypes`` into libc, because Python's ``os`` module exposes neither
``STATX_DIOALIGN`` nor ``statfs.f_type``. Each returns a neutral value when the kernel, libc or
filesystem cannot say, so callers only ever see "unknown", never an exception.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct

__all__ = ["STATX_DIOALIGN", "dio_alignment", "io_alignment", "fs_type"]

PAGE = 4096
STATX_DIOALIGN = 0x2000
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
# struct statx is 256 bytes: stx_mask (u32) at 0, stx_dio_mem_align and stx_dio_offset_align
# (u32 each) at 152 and 156. See statx(2).
_STATX_SIZE = 256
_OFF_DIO_MEM = 152
_OFF_DIO_OFFSET = 156

# statfs(2) f_type values of the filesystems a spill directory is likely to be on.
_FS_MAGIC = {
    0xEF53: "ext4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0xF2F52010: "f2fs",
    0x2FC12FC1: "zfs",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0x794C7630: "overlayfs",
    0x6969: "nfs",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x65735546: "fuse",
    0x01021997: "9p",
    0x5346414F: "afs",
    0x47504653: "gpfs",
    0x0BD00BD0: "lustre",
}

_libc: ctypes.CDLL | None = None


def _get_libc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        except OSError:  # pragma: no cover - no libc is not a Linux we run on
            return None
    return _libc


def dio_alignment(target: str | os.PathLike[str] | int) -> tuple[int, int]:
    """``(mem_align, offset_align)`` for O_DIRECT on ``target`` (a path or an open fd).

    ``(0, 0)`` when statx or STATX_DIOALIGN is unsupported (kernels before 6.1, old glibc), or
    when the file does not report it. Directories never report it: pass a regular file.
    """
    libc = _get_libc()
    fn = getattr(libc, "statx", None) if libc is not None else None
    if fn is None:
        return (0, 0)
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if isinstance(target, int):
        rc = fn(target, b"", _AT_EMPTY_PATH, STATX_DIOALIGN, buf)
    else:
        rc = fn(_AT_FDCWD, os.fsencode(target), 0, STATX_DIOALIGN, buf)
    if rc != 0:
        return (0, 0)
    (mask,) = struct.unpack_from("=I", buf.raw, 0)
    if not mask & STATX_DIOALIGN:
        return (0, 0)
    mem, off = struct.unpack_from("=II", buf.raw, _OFF_DIO_MEM)
    return (mem, off)


def io_alignment(dio: tuple[int, int]) -> int:
    """The alignment tba uses: the largest of 4096 and both DIOALIGN values."""
    align = max(PAGE, *dio)
    # A DIOALIGN value is a power of two; guard anyway, the allocator requires one.
    return 1 << (align - 1).bit_length()


def fs_type(path: str | os.PathLike[str]) -> str:
    """A short name for the filesystem holding ``path`` ("ext4", "tmpfs", ...), or "unknown"."""
    libc = _get_libc()
    fn = getattr(libc, "statfs", None) if libc is not None else None
    if fn is None:
        return "unknown"
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if fn(os.fsencode(path), buf) != 0:
        return "unknown"
    # f_type is the first member, a C long (__fsword_t) on Linux.
    magic = ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
    return _FS_MAGIC.get(magic, f"0x{magic:x}")
