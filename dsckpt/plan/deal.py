"""How work is split between the processes of a run: by bytes, the same answer on every process."""
from __future__ import annotations


def dealt(sizes: list[int], n: int) -> list[int]:
    """Which of ``n`` processes takes each item: the largest first, each to the least loaded process, so each gets
    about equal bytes whatever the order of the sizes (every n-th item would not: weights and biases alternate)."""
    load, owner = [0] * n, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner[i] = load.index(min(load))
        load[owner[i]] += sizes[i]
    return owner
