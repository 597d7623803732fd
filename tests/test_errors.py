"""The error types and the two messages every part shares."""

from __future__ import annotations

import pytest
import torch

import tba
from tba.errors import InternalError, internal_error, modified_error
from tba.storage.alloc import ExtentAllocator


def test_a_broken_invariant_says_it_is_a_bug_in_tba():
    al = ExtentAllocator(4 * 4096, 4096)
    with pytest.raises(InternalError, match=r"^tba\.storage: double free .* 4096\. This is a bug"):
        al.free(4096)
    err = internal_error("unpack", "an entry has no bytes")
    assert isinstance(err, tba.TBAError) and isinstance(err, RuntimeError)
    assert "please report it" in str(err) and "tba doctor" in str(err)


def test_the_inplace_error_reads_like_stock_pytorch():
    err = modified_error(torch.Size([2, 3]), torch.float32, 2, 1)
    assert isinstance(err, tba.UnpackError) and isinstance(err, RuntimeError)
    assert str(err).startswith("tba.unpack: one of the variables needed for gradient computation")
    assert "modified by an inplace operation" in str(err)
    assert "[2, 3]" in str(err) and "version 2; expected version 1" in str(err)
