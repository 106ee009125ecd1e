"""Paired timing: two callables alternating round by round, so this host's drifting memory and
clock states (its streaming-read roof switches between ~35 and ~55 GB/s from minute to minute) hit
both alike. Which one goes first alternates too: run in a fixed order, the second of a pair was
measured 2-5% faster or slower than it is (caches and threads left warm or busy by the first).
"""

import time

import numpy as np


def paired_times(first, second, rounds, *, before_each=None):
    """Time ``first()`` and ``second()`` in ``rounds`` adjacent pairs, alternating their order.

    ``before_each``, if given, is called (untimed) before every timed call: decode passes one
    that evicts the last-level cache, so neither run finds the other's data there.

    Returns
    -------
    first_seconds, second_seconds : float64 [rounds]
        Round i's two times, to be compared round by round (a ratio per round, then its median).
    """
    seconds = np.empty((rounds, 2))
    for i in range(rounds):
        order = ((0, first), (1, second)) if i % 2 == 0 else ((1, second), (0, first))
        for column, run in order:
            if before_each is not None:
                before_each()
            start = time.perf_counter()
            run()
            seconds[i, column] = time.perf_counter() - start
    return seconds[:, 0], seconds[:, 1]
