"""The compiled 16-bit conversions (kernels/convert.py) against NumPy: every bit pattern one way,
rounding ties, overflow and NaN the other."""

import numpy as np
import pytest

from pagekv.kernels import convert
from pagekv.kernels._dtypes import FORMAT_BFLOAT16, FORMAT_FLOAT16

ALL_BITS = np.arange(2**16, dtype=np.uint32).astype(np.uint16)


def widened(bits, kv_format):
    out = np.empty(bits.shape, np.float32)
    convert.widen(bits, kv_format, out)
    return out


def narrowed(values, kv_format):
    out = np.empty(values.shape, np.uint16)
    convert.narrow(values, kv_format, out)
    return out


def awkward_float32s():
    """Random values over every exponent, plus ties, the largest floats, infinities and NaNs."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**16, 1000, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000  # halfway
    edges = np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001,
                      0x7F800001, 0x00000001, 0x80000000, 0x477FE000, 0x477FF000, 0x38800000,
                      0x33800000, 0x33000000], np.uint32)  # f16: max, just past max, tiny subnormals
    return np.concatenate([bits, ties, edges]).view(np.float32)


def test_widen_bfloat16_every_bit_pattern():
    expected = (ALL_BITS.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(widened(ALL_BITS, FORMAT_BFLOAT16).view(np.uint32), expected.view(np.uint32))


def test_widen_float16_every_bit_pattern():
    got = widened(ALL_BITS, FORMAT_FLOAT16)
    expected = ALL_BITS.view(np.float16).astype(np.float32)
    numbers = ~np.isnan(expected)
    np.testing.assert_array_equal(got[numbers].view(np.uint32), expected[numbers].view(np.uint32))
    assert np.isnan(got[~numbers]).all()


def test_narrow_bfloat16_rounds_to_nearest_even():
    values = awkward_float32s()
    bits = values.view(np.uint32).astype(np.uint64)
    nearest_even = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    expected = np.where(np.isnan(values), np.uint16(convert.BFLOAT16_NAN), nearest_even)
    np.testing.assert_array_equal(narrowed(values, FORMAT_BFLOAT16), expected)


def test_narrow_bfloat16_round_trips_every_number():
    values = widened(ALL_BITS, FORMAT_BFLOAT16)
    numbers = ~np.isnan(values)
    np.testing.assert_array_equal(narrowed(values, FORMAT_BFLOAT16)[numbers], ALL_BITS[numbers])
    assert (narrowed(values[~numbers], FORMAT_BFLOAT16) == convert.BFLOAT16_NAN).all()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_narrow_float16_matches_numpy():
    values = awkward_float32s()
    expected = values.astype(np.float16).view(np.uint16)
    got = narrowed(values, FORMAT_FLOAT16)
    numbers = ~np.isnan(values)
    np.testing.assert_array_equal(got[numbers], expected[numbers])
    assert np.isnan(got[~numbers].view(np.float16)).all()
