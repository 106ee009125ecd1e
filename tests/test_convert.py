"""The compiled conversions (kernels/convert.py) against NumPy, the float8 twin
(pagekv.reference.float8) and torch: every bit pattern one way, rounding ties, overflow and NaN
the other."""

import numpy as np
import pytest

from pagekv.kernels import convert
from pagekv.kernels._dtypes import FORMAT_BFLOAT16, FORMAT_FLOAT16
from pagekv.reference import float8

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


# ------------------------------------------------------------------------------ float8 E4M3

def test_widen_float8_every_bit_pattern():
    bits = np.arange(256, dtype=np.uint16).astype(np.uint8)
    got = np.empty(256, np.float32)
    convert.widen_e4m3(bits, got)
    expected = float8.decode(bits)
    numbers = ~np.isnan(expected)
    np.testing.assert_array_equal(got[numbers], expected[numbers])
    assert np.isnan(got[~numbers]).all() and (~numbers).sum() == 2  # 0x7F and 0xFF
    np.testing.assert_array_equal(np.signbit(got[numbers]), np.signbit(expected[numbers]))  # -0.0


def float8_awkward_values():
    """awkward_float32s, plus every float8 number, the midpoints between neighbours (ties), and
    values around the largest (448) and the subnormals."""
    numbers = float8.VALUES[:0x7F]
    midpoints = (numbers[:-1] + numbers[1:]) / 2
    edges = np.array([447.0, 448.0, 449.0, 463.9, 464.0, 464.1, 480.0, 1e30, 2.0 ** -10, 2.0 ** -9.5,
                      2.0 ** -6 - 2.0 ** -12])
    mine = np.concatenate([numbers, midpoints, np.nextafter(midpoints, 0), edges]).astype(np.float32)
    return np.concatenate([awkward_float32s(), mine, -mine])


def test_narrow_float8_rounds_to_nearest_even_and_saturates():
    values = float8_awkward_values()
    got = np.empty(values.shape, np.uint8)
    convert.narrow_e4m3(values, got)
    np.testing.assert_array_equal(got, float8.encode(values))
    assert got[values == np.inf].tolist() == [0x7E] and got[values == 1e30].tolist() == [0x7E]


def test_float8_twin_agrees_with_torch():
    """The twin, written from the format's definition, against torch's float8_e4m3fn (an
    implementation of its own): every byte's value, and the rounding of every number within the
    range (torch's conversion of what lies beyond it is not the saturation pagekv's caches use)."""
    torch = pytest.importorskip("torch")
    bits = np.arange(256, dtype=np.uint16).astype(np.uint8)
    np.testing.assert_array_equal(float8.decode(bits),
                                  torch.from_numpy(bits).view(torch.float8_e4m3fn).double().numpy())
    values = float8_awkward_values()
    values = values[np.abs(values) <= 448]
    expected = torch.from_numpy(values).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(float8.encode(values), expected)
