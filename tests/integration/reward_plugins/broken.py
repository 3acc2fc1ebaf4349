"""Fails on every item (a run scored only by it trains nothing)."""


def reward(item):
    raise ValueError("the grader is broken")
