"""Sequence packing: place sequences into bins of a token budget.

- `first_fit_decreasing` (FFD): the fewest bins, as they fall; the last bin is
  often nearly empty.
- `balanced`: as many bins as FFD needs, with the tokens spread over them as
  evenly as FFD can (FFD into the smallest bin size that needs no more bins).
  Same number of micro-batches, so the same fixed costs per step, but the
  largest micro-batch, which sets the peak activation memory, holds about
  total / bins tokens instead of the budget.
"""

from __future__ import annotations

from collections.abc import Callable

PACKERS: dict[str, Callable[[list[int], int], list[list[int]]]] = {}


def _packer(fn: Callable[[list[int], int], list[list[int]]]) -> Callable[[list[int], int], list[list[int]]]:
    PACKERS[fn.__name__] = fn
    return fn


def get_packer(name: str) -> Callable[[list[int], int], list[list[int]]]:
    try:
        return PACKERS[name]
    except KeyError:
        raise ValueError(f"unknown packing algorithm {name!r}; valid: {', '.join(PACKERS)}") from None


def _check(lengths: list[int], capacity: int) -> None:
    too_long = [n for n in lengths if n > capacity]
    if too_long:
        raise ValueError(f"a sequence of {max(too_long)} tokens does not fit a bin of {capacity} tokens")


@_packer
def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of indices into `lengths` whose totals stay within `capacity` (FFD, <= 11/9 OPT + 6/9 bins).

    Deterministic: ties keep input order, and bins come out in creation order.
    """
    _check(lengths, capacity)
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


@_packer
def balanced(lengths: list[int], capacity: int) -> list[list[int]]:
    """As many bins as FFD needs at `capacity`, each as little full as FFD can make it.

    Bisects the smallest bin size, between the mean bin load and `capacity`, at which FFD still
    needs no more bins; keeps FFD's own bins if those happen to be less full. Deterministic.
    """
    ffd = first_fit_decreasing(lengths, capacity)
    if not lengths:
        return ffd
    lo, hi = max(max(lengths), -(-sum(lengths) // len(ffd))), capacity
    while lo < hi:
        mid = (lo + hi) // 2
        if len(first_fit_decreasing(lengths, mid)) <= len(ffd):
            hi = mid
        else:
            lo = mid + 1
    even = first_fit_decreasing(lengths, hi)
    return even if _fullest(lengths, even) <= _fullest(lengths, ffd) else ffd


def _fullest(lengths: list[int], bins: list[list[int]]) -> int:
    return max(sum(lengths[i] for i in b) for b in bins)
