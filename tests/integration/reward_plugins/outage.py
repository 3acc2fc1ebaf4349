"""A reward service outage of a few steps, as a plug-in."""

from rlserve.rewards.builtins import ExactMatch


class Outage:
    """Partial-credit exact match that raises on the items numbered [fail_from, fail_until) it sees."""

    def __init__(self, fail_from: int, fail_until: int):
        self.inner, self.seen, self.window = ExactMatch(partial_credit=True), 0, range(fail_from, fail_until)

    def __call__(self, item):
        n, self.seen = self.seen, self.seen + 1
        if n in self.window:
            raise RuntimeError(f"scheduled outage at item {n}")
        return self.inner(item)
