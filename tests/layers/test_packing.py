"""Round trips and layout of the 1-bit and 2-bit packers."""

import pytest
import torch

import tba.layers as L

SIZES = [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 1001]


@pytest.mark.parametrize("n", SIZES)
def test_bits_round_trip(n):
    gen = torch.Generator().manual_seed(n)
    mask = torch.rand(n, generator=gen) > 0.5
    packed = L.pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.shape == (-(-n // 8),)
    assert L.packed_nbytes(n, 1) == packed.numel()
    assert torch.equal(L.unpack_bits(packed, (n,)), mask)


@pytest.mark.parametrize("n", SIZES)
def test_2bit_round_trip(n):
    gen = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 4, (n,), generator=gen, dtype=torch.uint8)
    packed = L.pack_2bit(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (-(-n // 4),)
    assert L.packed_nbytes(n, 2) == packed.numel()
    assert torch.equal(L.unpack_2bit(packed, (n,)), codes)


@pytest.mark.parametrize("shape", [(3, 5, 7), (1, 1001), (7, 1, 3)])
def test_round_trip_keeps_shape_and_handles_views(shape):
    mask = torch.rand(shape) > 0.3
    codes = torch.randint(0, 4, shape, dtype=torch.uint8)
    view = mask.transpose(0, -1)  # non-contiguous input packs in logical order
    assert torch.equal(L.unpack_bits(L.pack_bits(view), view.shape), view)
    assert torch.equal(L.unpack_bits(L.pack_bits(mask), shape), mask)
    assert torch.equal(L.unpack_2bit(L.pack_2bit(codes), shape), codes)


def test_layout_is_little_endian_and_padding_is_zero():
    bits = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)
    assert L.pack_bits(bits).tolist() == [0b1000_0001, 0b0000_0001]
    codes = torch.tensor([3, 0, 1, 2, 1], dtype=torch.uint8)
    assert L.pack_2bit(codes).tolist() == [3 | 1 << 4 | 2 << 6, 1]


def test_unpack_rejects_wrong_tensors():
    with pytest.raises(L.LayerShapeError, match=r"expected a 1-D uint8 tensor, got torch.int64"):
        L.unpack_bits(torch.zeros(2, dtype=torch.int64), (9,))
    with pytest.raises(
        L.LayerShapeError, match=r"2 packed bytes cannot hold exactly 17 1-bit codes \(need 3\)"
    ):
        L.unpack_bits(torch.zeros(2, dtype=torch.uint8), (17,))
    with pytest.raises(ValueError, match=r"cannot hold exactly 3 2-bit codes \(need 1\)"):
        L.unpack_2bit(torch.zeros(2, dtype=torch.uint8), (3,))
