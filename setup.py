"""Build the Cython extension; all metadata lives in pyproject.toml."""
import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

# Cython directives live here and only here. Bounds and wraparound checks are off because every index
# the extension uses is validated at its Python boundary (or produced by its own bookkeeping).
CYTHON_DIRECTIVES = {
    "language_level": 3,
    "binding": True,
    "embedsignature": True,
    "embedsignature.format": "clinic",  # __text_signature__, so inspect sees non-binding methods
    "boundscheck": False,
    "wraparound": False,
    "initializedcheck": False,
    "cdivision": True,
    "freethreading_compatible": True,
}

extensions = [
    Extension(
        "pagekv._alloc",
        ["pagekv/_alloc.pyx"],
        include_dirs=[np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O3"],
    )
]

setup(ext_modules=cythonize(extensions, compiler_directives=CYTHON_DIRECTIVES))
