"""How much of a memory range the kernel backs with transparent huge pages (Linux), for tests."""

import pathlib

import numpy as np
import pytest

SMAPS = pathlib.Path("/proc/self/smaps")


def huge_page_kib(address, nbytes):
    """KiB of transparent huge pages in the mappings that overlap [address, address + nbytes)."""
    total, overlaps = 0, False
    for line in SMAPS.read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header: lo-hi perms ...
            low, high = (int(bound, 16) for bound in fields[0].split("-"))
            overlaps = low < address + nbytes and high > address
        elif overlaps and fields[0] == "AnonHugePages:":
            total += int(fields[1])
    return total


def skip_unless_numpy_gets_huge_pages(nbytes):
    """Skip where this kernel gives numpy's own large arrays no huge pages (THP off, or none
    free): there the code under test has nothing to get either."""
    if not SMAPS.exists():
        pytest.skip("no /proc/self/smaps: not Linux")
    array = np.empty(nbytes, np.uint8)
    array[...] = 1  # touch every page
    if huge_page_kib(array.ctypes.data, array.nbytes) == 0:
        pytest.skip("this kernel gives numpy's large arrays no transparent huge pages")
