"""Sequence packing: place sequences into bins of a token budget, first-fit decreasing."""

from __future__ import annotations


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of indices into `lengths` whose totals stay within `capacity` (FFD, <= 11/9 OPT + 6/9 bins).

    Deterministic: ties keep input order, and bins come out in creation order.
    """
    too_long = [n for n in lengths if n > capacity]
    if too_long:
        raise ValueError(f"a sequence of {max(too_long)} tokens does not fit a bin of {capacity} tokens")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins
