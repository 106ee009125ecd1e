"""Plain-Python and NumPy twins of pagekv's fast paths.

Each twin is written for clarity, not speed: it is the oracle that tests compare the fast code with,
and a readable specification of what the fast code must do.
"""

from pagekv.reference.allocator import ReferencePageAllocator

__all__ = ["ReferencePageAllocator"]
