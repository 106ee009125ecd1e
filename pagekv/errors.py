"""The error classes of pagekv.

Each subclasses the builtin a caller would already catch for the same mistake (as ``set.remove``
raises ``KeyError``), so ``except MemoryError`` still catches running out of pages.
"""

__all__ = [
    "PagekvError",
    "OutOfPagesError",
    "InvalidPageError",
    "PageStateError",
    "UnknownSequenceError",
    "InvariantError",
]


class PagekvError(Exception):
    """Base class of every error pagekv raises on purpose."""


class OutOfPagesError(PagekvError, MemoryError):
    """Fewer free pages than a request needs; nothing was allocated.

    Attributes
    ----------
    requested : int
        Pages the failed call asked for.
    available : int
        Pages that were free when it failed.
    """

    def __init__(self, requested: int, available: int) -> None:
        self.requested = int(requested)
        self.available = int(available)
        super().__init__(
            f"expected at most {self.available} pages (the free ones), got a request for {self.requested}"
        )

    def __reduce__(self):
        return (type(self), (self.requested, self.available))


class InvalidPageError(PagekvError, IndexError):
    """A page id outside ``[0, num_pages)``."""


class PageStateError(PagekvError, ValueError):
    """An operation that the page's state forbids: a double free, an incref of a free page."""


class UnknownSequenceError(PagekvError, KeyError):
    """A sequence id the manager does not hold."""

    def __str__(self) -> str:  # KeyError would repr() the message and add quotes
        return str(self.args[0]) if self.args else ""


class InvariantError(PagekvError, RuntimeError):
    """An internal invariant is broken (found by an audit such as ``PageAllocator.check``).

    Not a caller's mistake: it means memory corruption or a bug in pagekv, and is worth a report.
    """
