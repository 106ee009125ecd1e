"""The float8 E4M3 format (OCP's ``float8_e4m3fn``) from its definition: the twin of the kernels'
widening (kernels/_dtypes.py) and of the rounding that writes float8 caches (kernels/convert.py).

A byte ``s eeee mmm`` is ``(-1)**s * 2**(e - 7) * (1 + m / 8)`` for e >= 1, ``(-1)**s * 2**-6 *
m / 8`` for e = 0 (subnormals), and NaN for ``eeee mmm = 1111 111``; there are no infinities, and
the largest finite number is 448. Writing rounds to the nearest number (ties to the even byte) and
saturates: anything beyond 448 in magnitude, infinities too, becomes +-448; NaN stays NaN.
"""

import numpy as np

__all__ = ["E4M3_MAX", "decode", "encode"]

E4M3_MAX = 448.0


def _byte_value(byte):
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:
        return sign * 2.0 ** -6 * mantissa / 8
    return sign * 2.0 ** (exponent - 7) * (1 + mantissa / 8)


VALUES = np.array([_byte_value(byte) for byte in range(256)])  # float64 [256], by byte
_ASCENDING = VALUES[:0x7F]  # bytes 0x00..0x7E: the non-negative finite numbers, in order


def decode(bits):
    """float64 values of E4M3 bytes: uint8 array -> float64 array of its shape."""
    return VALUES[np.asarray(bits, np.uint8)]


def encode(values):
    """E4M3 bytes of float values, rounded to nearest (ties to the even byte), saturated at +-448.

    values : float array -> uint8 array of its shape.
    """
    with np.errstate(invalid="ignore"):  # signalling NaNs: quiet ones after the cast, still NaN
        values = np.asarray(values, np.float64)
    magnitude = np.minimum(np.abs(np.nan_to_num(values)), E4M3_MAX)
    above = np.minimum(np.searchsorted(_ASCENDING, magnitude), 0x7E)  # first number >= magnitude
    below = np.maximum(above - 1, 0)
    to_above, to_below = _ASCENDING[above] - magnitude, magnitude - _ASCENDING[below]
    tie_goes_up = (to_above == to_below) & (above % 2 == 0)
    byte = np.where((to_above < to_below) | tie_goes_up, above, below).astype(np.uint8)
    byte |= np.where(np.signbit(values), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(values), np.uint8(0x7F), byte).astype(np.uint8)
