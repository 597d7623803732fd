"""Keep-or-offload decisions."""

from __future__ import annotations

import torch
import torch.nn as nn

from tba.decide.keep import Policy, is_parameter_like, unsupported


def test_parameters_and_their_views_are_excluded():
    lin = nn.Linear(4, 4)
    w = lin.weight
    assert is_parameter_like(w, set())
    assert is_parameter_like(w.t(), set())
    assert is_parameter_like(w[1:], set())
    leaf = torch.randn(3, requires_grad=True)
    assert is_parameter_like(leaf, set())
    act = lin(torch.randn(2, 4))
    assert not is_parameter_like(act, set())
    alias = torch.empty(0).set_(w.detach().untyped_storage())
    assert is_parameter_like(alias, {w.untyped_storage()._cdata})


def test_unsupported_tensors():
    assert unsupported(torch.randn(4, 4).to_sparse())
    assert unsupported(torch.empty(0))
    assert unsupported(torch.empty(3, device="meta"))
    assert not unsupported(torch.randn(3))


def test_keep_reasons():
    p = Policy(min_offload_bytes=1024)
    assert p.keep_reason(4096, False) is None
    assert p.keep_reason(100, False) == "small"
    assert p.keep_reason(4096, True) == "group"
    assert p.keep_reason(0, False) == "small"
