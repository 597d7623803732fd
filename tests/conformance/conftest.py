"""Stock PyTorch against tba: the fixtures and comparisons every conformance case uses.

A case is a function ``fn(fwd)`` that builds its inputs, runs a forward inside ``with fwd():``
and returns what it wants compared (outputs, gradients, flags) or raises. :func:`run_both` runs
it twice from the same seed: once stock (``fwd`` opens nothing), once under tba (``fwd`` opens an
Offloader's step), and asserts that both give bit-identical results, or raise the same type of
error with a matching message. Stock's result is always the reference: no case compares with a
constant. A case about an error names it (``raises=RuntimeError``), and stock must raise it, so
that a mistake in a case, failing both runs alike, cannot pass as agreement.

Two tba modes run for every case (the ``under_tba`` fixture is parametrized):

- ``everything``: every saved tensor is eligible (``min_offload_bytes=1``), none is kept
  (``keep_last=0``), no coalescing, checksums on; the step's writes are waited for before the
  forward returns, so that backward reads from disk every saved tensor that is no longer alive
  (a live one is handed back as it is).
- ``default``: the default policy of ``tba.Config`` (small tensors stay in memory).

A deviation of tba from stock is a strict xfail naming the bug, on the test (both modes) or
through :func:`xfail_in` (one mode); the test itself stays as it should be.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import tba
from tba.testing import warm_cpu_math

MODES = ("everything", "default")
INPLACE = "modified by an inplace operation"


def mode_config(mode: str, spill_dir: str) -> tba.Config:
    if mode == "everything":
        return tba.Config(
            environ={},
            spill_dir=spill_dir,
            backend="posix",
            min_offload_bytes=1,
            keep_last=0,
            coalesce_bytes=0,
            checksum="auto",
        )
    if mode == "default":
        return tba.Config(environ={}, spill_dir=spill_dir)
    raise ValueError(mode)


class UnderTba:
    """One Offloader for one test; calling it gives the context manager of a forward.

    ``under_tba()`` opens ``off.step()``; in mode ``everything`` it also waits for the step's
    writes once the step has ended, before the caller's backward.
    """

    def __init__(self, mode: str, spill_dir: str):
        self.mode = mode
        self.off = tba.Offloader(mode_config(mode, spill_dir))

    @contextlib.contextmanager
    def __call__(self) -> Iterator[tba.Offloader]:
        with self.off.step():
            yield self.off
        if self.mode == "everything":
            self.off.synchronize()

    def settle(self) -> None:
        """Wait for every write and read, and let dead handles go (before lifetime checks)."""
        gc.collect()
        self.off.synchronize()
        gc.collect()
        self.off.synchronize()

    def close(self) -> None:
        self.off.close()


@pytest.fixture(scope="session", autouse=True)
def _warm_math():
    warm_cpu_math()  # bit-exact CPU references need every VML function called once first


@pytest.fixture(params=MODES)
def under_tba(request, tmp_path) -> Iterator[UnderTba]:
    runner = UnderTba(request.param, str(tmp_path / "spill"))
    try:
        yield runner
    finally:
        runner.close()


def xfail_in(request, under_tba: UnderTba, mode: str, reason: str) -> None:
    """Mark this test a strict xfail in one mode only (a deviation the other mode lacks)."""
    if under_tba.mode == mode:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))


def stock() -> contextlib.AbstractContextManager:
    """The stock run's ``fwd``: a forward with nothing around it."""
    return contextlib.nullcontext()


# -- outcomes ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None


def outcome(fn: Callable[[Callable], Any], fwd: Callable, seed: int) -> Outcome:
    torch.manual_seed(seed)
    try:
        return Outcome(value=fn(fwd))
    except Exception as err:  # compared with the other run's outcome by the caller
        return Outcome(error=err)


def run_both(
    fn: Callable[[Callable], Any],
    under_tba: UnderTba,
    *,
    seed: int = 0,
    raises: type[BaseException] | None = None,
    phrase: str | None = None,
    strides: bool = True,
) -> Outcome:
    """Run ``fn`` stock, then under tba, and assert the same outcome; returns stock's.

    ``raises``: the error the case is about, which stock must raise (so that a mistake in a
    case, failing both runs alike, cannot pass as agreement); without it stock must return.
    When stock raises, tba must raise an instance of the same type; its message must contain
    ``phrase`` (which stock's must contain too), or, without a phrase, equal stock's message
    (autograd's own error passed through unchanged).
    """
    ref = outcome(fn, stock, seed)
    check_reference(ref, raises)
    got = outcome(fn, under_tba, seed)
    assert_same_outcome(ref, got, phrase=phrase, strides=strides)
    return ref


def check_reference(ref: Outcome, raises: type[BaseException] | None) -> None:
    """Stock did what the case expects of it: raised ``raises``, or returned."""
    if raises is None:
        if ref.error is not None:
            raise AssertionError(
                f"the case is broken: stock raised {type(ref.error).__name__}: {ref.error}"
            ) from ref.error
    else:
        assert isinstance(ref.error, raises), (
            f"the case is broken: stock was expected to raise {raises.__name__}, got "
            f"{ref.error!r}" + ("" if ref.error is not None else f" (returned {ref.value!r})")
        )


def assert_same_outcome(
    ref: Outcome, got: Outcome, *, phrase: str | None = None, strides: bool = True
) -> None:
    if ref.error is not None:
        assert got.error is not None, (
            f"stock raised {type(ref.error).__name__}: {ref.error}; tba returned {got.value!r}"
        )
        assert isinstance(got.error, type(ref.error)), (
            f"stock raised {type(ref.error).__name__}: {ref.error}\n"
            f"tba raised {type(got.error).__name__}: {got.error}"
        )
        if phrase is not None:
            assert phrase in str(ref.error), f"stock's message lacks {phrase!r}: {ref.error}"
            assert phrase in str(got.error), f"tba's message lacks {phrase!r}: {got.error}"
        else:
            assert str(got.error) == str(ref.error)
        return
    if got.error is not None:
        raise AssertionError(
            f"stock returned, tba raised {type(got.error).__name__}: {got.error}"
        ) from got.error
    assert_identical(ref.value, got.value, strides=strides)


# -- bit-identical values ------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as raw bytes (so NaNs and signed zeros compare exactly)."""
    t = t.detach().resolve_conj().resolve_neg()
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.to(torch.uint8)
    return flat.view(torch.uint8)


def assert_identical(a: Any, b: Any, *, strides: bool = True, where: str = "result") -> None:
    """``a`` and ``b`` are the same pytree of bit-identical tensors (and equal other leaves)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: {type(b).__name__}, expected a tensor"
        assert type(a) is type(b), f"{where}: {type(b).__name__}, expected {type(a).__name__}"
        assert a.dtype == b.dtype, f"{where}: dtype {b.dtype}, expected {a.dtype}"
        assert a.layout == b.layout, f"{where}: layout {b.layout}, expected {a.layout}"
        assert a.device == b.device, f"{where}: device {b.device}, expected {a.device}"
        assert a.requires_grad == b.requires_grad, f"{where}: requires_grad differs"
        if a.is_nested:
            assert b.is_nested, f"{where}: not nested"
            xs, ys = a.unbind(), b.unbind()
            assert len(xs) == len(ys), f"{where}: {len(ys)} components, expected {len(xs)}"
            for i, (x, y) in enumerate(zip(xs, ys)):
                assert_identical(x, y, strides=strides, where=f"{where}[{i}]")
            return
        assert a.shape == b.shape, f"{where}: shape {tuple(b.shape)}, expected {tuple(a.shape)}"
        if a.layout == torch.sparse_coo:
            a, b = a.detach().coalesce(), b.detach().coalesce()
            assert torch.equal(a.indices(), b.indices()), f"{where}: sparse indices differ"
            assert torch.equal(_bits(a.values()), _bits(b.values())), f"{where}: values differ"
            return
        if strides and a.layout == torch.strided:
            assert a.stride() == b.stride(), f"{where}: stride {b.stride()}, expected {a.stride()}"
        assert a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg(), f"{where}: conj/neg bit"
        assert torch.equal(_bits(a), _bits(b)), f"{where}: values differ\n{a}\n{b}"
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {b!r}, expected {a!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, strides=strides, where=f"{where}[{i}]")
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for k in a:
            assert_identical(a[k], b[k], strides=strides, where=f"{where}[{k!r}]")
        return
    assert a == b, f"{where}: {b!r}, expected {a!r}"
