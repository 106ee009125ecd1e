"""Wrong values for the boundary walks: each test replaces one argument of a public call by each
value here that applies to it, and checks the call works or raises "expected ..." cleanly."""

import numpy as np

from pagekv import PagekvError


def _strided(a):
    return a[..., ::2] if a.ndim and a.shape[-1] > 1 else a[None]


def _read_only(a):
    a = a.copy()
    a.setflags(write=False)
    return a


def _entry(value):
    def set_first(a):
        a = a.copy()
        a.flat[0] = value
        return a
    return set_first


# Each: (name, applies to this value?, the wrong value). Read-only caches are left to the writers:
# reading through one is fine, and would compile every kernel again for read-only array types.
ARRAY = lambda x: isinstance(x, np.ndarray)  # noqa: E731
FLOATS = lambda x: ARRAY(x) and x.dtype.kind == "f"  # noqa: E731
INTS = lambda x: ARRAY(x) and x.dtype.kind in "iu" and x.size > 0  # noqa: E731
ANY = lambda x: True  # noqa: E731
MUTATIONS = [
    ("None", ANY, lambda x: None), ("a string", ANY, lambda x: "x"), ("a float", ANY, lambda x: 2.5),
    ("True", ANY, lambda x: True), ("-1", ANY, lambda x: -1), ("10**12", ANY, lambda x: 10**12),
    ("10**30", ANY, lambda x: 10**30), ("numpy's True", ANY, lambda x: np.True_),
    ("an object", ANY, lambda x: object()), ("[]", ANY, lambda x: []), ("[[1]]", ANY, lambda x: [[1]]),
    ("float64", ARRAY, lambda a: a.astype(np.float64)), ("int64", ARRAY, lambda a: a.astype(np.int64)),
    ("bool", ARRAY, lambda a: a.astype(bool)), ("complex", ARRAY, lambda a: a.astype(np.complex64)),
    ("strided", ARRAY, _strided), ("one more axis", ARRAY, lambda a: a[None]),
    ("flattened", ARRAY, lambda a: a.reshape(-1)), ("one row fewer", ARRAY, lambda a: a[1:]),
    ("transposed", ARRAY, lambda a: a.T.copy() if a.ndim > 1 else a),
    ("Fortran order", ARRAY, np.asfortranarray), ("a list", ARRAY, lambda a: a.tolist()),
    ("an empty second axis", ARRAY, lambda a: a[:, :0] if a.ndim > 1 else a[:0]),
    ("an empty last axis", ARRAY, lambda a: a[..., :0]),
    ("float16", FLOATS, lambda a: a.astype(np.float16)), ("a NaN", FLOATS, _entry(np.nan)),
    ("an entry past int32", INTS, lambda a: _entry(2**40)(a.astype(np.int64))),
    ("a negative entry", INTS, _entry(-7)), ("a huge entry", INTS, _entry(2**31 - 1)),
]
READ_ONLY = ("read-only", FLOATS, _read_only)
# Wrong lists of sequence ids, for the arguments that take one.
SEQ_ID_LISTS = [("a repeated id", ["a", "a"]), ("an unknown id", ["a", "zz"]), ("a str", "ab"),
                ("a dict", {"a": 1}), ("a set", {"a"}), ("an unhashable id", [["a"]])]


def refusal_problem(call, state):
    """What is wrong with how ``call()`` took a wrong argument, or None: it must work, or raise
    ValueError/TypeError/PagekvError saying "expected ..." with ``state()`` as before — never an
    error from deeper down (numpy, Numba, iteration, an attribute)."""
    before = state()
    try:
        call()
    except (ValueError, TypeError, PagekvError) as exc:
        if "expected" not in str(exc):
            return repr(exc)
        if state() != before:
            return f"refused ({exc}) but changed the state"
    except Exception as exc:  # noqa: BLE001  # any other error is the finding
        return repr(exc)
    return None
