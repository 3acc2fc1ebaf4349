"""Raises for the completion '9', scores 0.5 otherwise (an item-level plug-in error)."""


def reward(item):
    if item.completion == "9":
        raise KeyError("oops")
    return 0.5
