"""Load reward functions by name (`rlserve.catalog.REWARD_FUNCTIONS`: the built-ins and the cluster's
enabled plug-ins) or by import path, and combine them with weights."""

from __future__ import annotations

import hashlib
import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

from rlserve.catalog import REWARD_FUNCTIONS
from rlserve.registry import import_object
from rlserve.rewards.config import RewardFunctionCfg
from rlserve.rewards.interfaces import BatchRewardFunction, RewardInput, RewardOutput
from rlserve.security.plugins import DEFAULT_ATTRIBUTE


class Scored(NamedTuple):
    """One item's weighted total, each function's unweighted score, their info and their metrics."""

    total: float
    components: dict[str, float]
    info: dict[str, Any]
    metrics: dict[str, float]


def load_function(spec: RewardFunctionCfg) -> Callable[[RewardInput], RewardOutput]:
    """Instantiate one reward function; classes get `args` as keyword arguments."""
    obj = import_object(spec.import_path, DEFAULT_ATTRIBUTE) if spec.import_path else REWARD_FUNCTIONS.load(spec.name)
    args = dict(spec.args)
    if inspect.isclass(obj):
        try:
            return obj(**args)
        except TypeError as err:
            raise ValueError(f"reward function {spec.name!r}: bad args {args}: {err}") from None
    if args:
        raise ValueError(f"reward function {spec.name!r} is a plain function and takes no args")
    return obj


class CombinedReward:
    """Weighted sum of several functions; an item fails when any function fails on it or returns a non-finite value."""

    def __init__(self, specs: list[RewardFunctionCfg]):
        if not specs:
            raise ValueError("no reward functions given")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"reward function names must be unique, got {names}")
        self.specs = specs
        self.functions = [load_function(s) for s in specs]
        self.version = hashlib.sha1("\n".join(s.key() for s in specs).encode()).hexdigest()[:12]

    def __call__(self, item: RewardInput) -> Scored:
        """One item's score, its components and info; raises when a function fails."""
        out = self.score_many([item])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def score_many(self, items: list[RewardInput]) -> list[Scored | Exception]:
        """Each item's `Scored`, or the exception of the first function that failed on it: batch
        functions see every item at once, the others one at a time."""
        outputs = [self._outputs(fn, items) for fn in self.functions]
        return [self._combine([outs[i] for outs in outputs]) for i in range(len(items))]

    @staticmethod
    def _outputs(fn: Callable[[RewardInput], Any], items: list[RewardInput]) -> list[Any]:
        if isinstance(fn, BatchRewardFunction):
            try:
                outs = fn.score_batch(items)
            except Exception as err:  # noqa: BLE001 - a failed batch fails each of its items
                return [err] * len(items)
            if len(outs) != len(items):
                return [ValueError(f"score_batch returned {len(outs)} outputs for {len(items)} items")] * len(items)
            return outs
        outs = []
        for item in items:
            try:
                outs.append(fn(item))
            except Exception as err:  # noqa: BLE001 - one item's failure is that item's
                outs.append(err)
        return outs

    def _combine(self, outs: list[Any]) -> Scored | Exception:
        total, components, info, metrics = 0.0, {}, {}, {}
        for spec, out in zip(self.specs, outs):
            if isinstance(out, Exception):
                return out
            score = out.score if isinstance(out, RewardOutput) else out
            if isinstance(score, bool) or not isinstance(score, (int, float)):
                return TypeError(f"{spec.name} returned {type(score).__name__}, not a number")
            if not math.isfinite(score):
                return ValueError(f"{spec.name} returned a non-finite score {score}")
            components[spec.name] = float(score)
            if isinstance(out, RewardOutput):
                if out.info:
                    info[spec.name] = out.info
                metrics.update({f"{spec.name}/{k}": float(v) for k, v in out.metrics.items()})
            total += spec.weight * float(score)
        return Scored(total, components, info, metrics)
