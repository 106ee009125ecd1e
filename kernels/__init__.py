"""Numba kernels of pagekv, installed as ``pagekv.kernels`` (source folder ``kernels/``).

The kernels trust their input: shapes, dtypes and page ids are validated by the public wrappers in
``pagekv.attention``.
"""
