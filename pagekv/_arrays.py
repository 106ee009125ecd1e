"""Arrays at the public boundary: numpy and torch CPU tensors in, zero-copy storage views out.

Kernels see four storage kinds: float32 arrays, uint16 arrays holding float16 or bfloat16 bit
patterns (Numba takes no float16 array and has no bfloat16), and uint8 arrays holding float8 E4M3
bit patterns (caches only). This module maps what callers hold onto those views without copying,
and converts the small per-call arrays (queries, outputs) between float32 and the 16-bit kinds.

Accepted storage:
- numpy float32, float16; ``ml_dtypes.bfloat16``; uint16 (read as bfloat16 bit patterns, so
  numpy-only users can keep bfloat16 caches);
- torch CPU tensors of float32, float16, bfloat16 (through ``Tensor.numpy()`` on a 16-bit view);
- for caches and the keys and values written into them, also float8 E4M3 (OCP's, no infinities):
  ``ml_dtypes.float8_e4m3fn``, torch ``float8_e4m3fn``, or uint8 (read as its bit patterns).
"""

import numpy as np

KINDS = ("float32", "float16", "bfloat16", "float8_e4m3fn")
KV_FORMAT = {"float32": 0, "float16": 1, "bfloat16": 2, "float8_e4m3fn": 3}  # codes of kernels/_dtypes.py


# Where a cache allocated here starts: on a cache line, 64 bytes past a 4 KiB boundary (where
# torch's CPU allocator starts large tensors too). numpy starts a large array 16 bytes past a 4 KiB
# boundary, so every 64-byte vector load of a page row straddles two lines. Measured on S1 decode,
# variants rotated through the rounds: one thread, bfloat16 41% of the roof there, 54% on a line.
# A start exactly on a 4 KiB boundary measured below other line offsets (float32, two threads: S1
# 84% vs 88-89%, S3 73% vs 76-77%); an unverified guess: loads falsely matched against the
# kernels' scratch stores, which the CPU compares on address bits 0-11 first.
START_PAST_4K = 64


def zeros_on_line(shape, dtype):
    """Zeroed array of ``shape`` and ``dtype`` whose data starts :data:`START_PAST_4K` bytes past a
    4 KiB boundary (on a cache line). Like ``np.zeros``, its pages are only touched when written."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.zeros(nbytes + 4096 + START_PAST_4K, np.uint8)
    start = (START_PAST_4K - raw.ctypes.data) % 4096
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def torch_zeros_on_line(shape, dtype):
    """``torch.zeros(shape, dtype=dtype)`` (float32, float16, bfloat16, float8_e4m3fn) in the memory of
    :func:`zeros_on_line`: on a cache line and, on Linux, in transparent huge pages. numpy asks
    the kernel for huge pages on large arrays (``madvise``); torch's CPU allocator does not unless
    ``THP_MEM_ALLOC_ENABLE=1`` is set, and a cache in 4 KiB pages walks the page tables on every
    page it jumps to: S1 bfloat16 decode from a ``torch.zeros`` cache took 1.17-1.19x the time of
    the same cache here (1.02-1.04x with that variable set)."""
    import torch  # type: ignore[import-not-found]  # optional: only reached by torch users

    words = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.int16,
             torch.float8_e4m3fn: np.uint8}
    return torch.from_numpy(zeros_on_line(shape, words[dtype])).view(dtype)


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def float_storage(x, name, *, float8=False):
    """A zero-copy numpy view of float data and its logical kind.

    ``float8``: float8 E4M3 is accepted too (caches, and keys and values written into them).

    Returns
    -------
    array : ndarray of float32, uint16 or (float8) uint8
    kind : {"float32", "float16", "bfloat16", "float8_e4m3fn"}
    """
    expected = ("float32, float16, bfloat16 or float8_e4m3fn (or uint16 bfloat16 bits, uint8 "
                "float8_e4m3fn bits)" if float8 else
                "float32, float16 or bfloat16 (or uint16 bfloat16 bits)")
    if is_torch(x):
        import torch  # type: ignore[import-not-found]  # optional: only reached with a tensor

        if x.device.type != "cpu":
            raise ValueError(f"expected a CPU tensor for {name}, got device {x.device}")
        x = x.detach()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(np.uint16), "bfloat16"
        if float8 and x.dtype == torch.float8_e4m3fn:
            return x.view(torch.uint8).numpy(), "float8_e4m3fn"
        if x.dtype not in (torch.float32, torch.float16):
            raise TypeError(f"expected {expected} for {name}, got {x.dtype}")
        array = x.numpy()
    else:
        array = np.asarray(x)
    dtype = array.dtype
    if dtype == np.float32:
        return array, "float32"
    if dtype == np.uint16:
        return array, "bfloat16"
    if dtype == np.float16:
        return array.view(np.uint16), "float16"
    if float8 and dtype == np.uint8:
        return array, "float8_e4m3fn"
    name_of_dtype = dtype.name  # ml_dtypes; .name is slow (~2 us), so it is asked last
    if name_of_dtype == "bfloat16":
        return array.view(np.uint16), "bfloat16"
    if float8 and name_of_dtype == "float8_e4m3fn":
        return array.view(np.uint8), "float8_e4m3fn"
    raise TypeError(f"expected {expected} for {name}, got {array.dtype}")


def int_array(x, name, ndim):
    """An int32 numpy array (zero-copy when it already is one) of ``ndim`` dimensions."""
    array = x.detach().numpy() if is_torch(x) else np.asarray(x)
    if array.ndim != ndim:
        raise ValueError(f"expected a {ndim}-D array for {name}, got {array.ndim}-D with shape {array.shape}")
    if array.dtype.kind not in "iu":
        raise TypeError(f"expected an integer dtype for {name}, got {array.dtype}")
    if array.dtype != np.int32:
        if array.size and (array.max() > np.iinfo(np.int32).max or array.min() < np.iinfo(np.int32).min):
            raise ValueError(f"expected {name} values within int32, got {array.min()}..{array.max()}")
        array = array.astype(np.int32)
    return np.ascontiguousarray(array)


def new_like(x, kind, shape):
    """A new array of the caller's kind (torch tensor or numpy) and ``kind``, with its storage view."""
    if is_torch(x):
        import torch  # type: ignore[import-not-found]  # optional: only reached with a tensor

        tensor = torch.empty(shape, dtype=x.dtype)
        return tensor, float_storage(tensor, "out")[0]
    if kind == "float32":
        array = np.empty(shape, np.float32)
        return array, array
    dtype = np.float16 if kind == "float16" else np.asarray(x).dtype
    array = np.empty(shape, dtype)
    return array, array.view(np.uint16)
