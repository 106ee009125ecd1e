"""The installed package: compiled extension, stubs, typed marker, subpackage mapping, doctests."""

import doctest
import importlib
import pathlib
import subprocess
import sys

import pytest

import pagekv
import pagekv._alloc

PACKAGE_DIR = pathlib.Path(pagekv.__file__).parent


def test_extension_is_compiled():
    assert pathlib.Path(pagekv._alloc.__file__).suffix in {".so", ".pyd"}


def test_stub_and_typed_marker_are_installed():
    assert (PACKAGE_DIR / "_alloc.pyi").is_file()
    assert (PACKAGE_DIR / "py.typed").is_file()


def test_stub_matches_the_compiled_module(tmp_path):
    # -I and an empty working directory: mypy searches the working directory too, and the
    # repository's source folder must not shadow the installed package.
    result = subprocess.run([sys.executable, "-I", "-m", "mypy.stubtest", "pagekv._alloc"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kernels_folder_is_installed_as_pagekv_kernels():
    kernels = importlib.import_module("pagekv.kernels")
    assert pathlib.Path(kernels.__file__).parent == PACKAGE_DIR / "kernels"


@pytest.mark.parametrize("module", ["pagekv._alloc", "pagekv.manager", "pagekv.spec", "pagekv.cache",
                                    "pagekv.tables", "pagekv.attention"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_public_api():
    for name in pagekv.__all__:
        assert getattr(pagekv, name) is not None
    assert issubclass(pagekv.OutOfPagesError, MemoryError)
    assert issubclass(pagekv.InvalidPageError, IndexError)
    assert issubclass(pagekv.PageStateError, ValueError)
    assert issubclass(pagekv.UnknownSequenceError, KeyError)


def test_readme_examples_run():
    readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    result = doctest.testfile(str(readme), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_package_type_checks(tmp_path):
    # The repository's mypy settings (pyproject.toml), read from an empty working directory.
    config = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
    result = subprocess.run([sys.executable, "-I", "-m", "mypy", "--config-file", str(config),
                             "-p", "pagekv"], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
