"""Load an environment by built-in name or import path (the plug-in allow-list is the caller's check)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from rlserve.environments.builtins import GuessNumber, SingleTurn
from rlserve.environments.config import EnvironmentCfg
from rlserve.environments.interfaces import Environment
from rlserve.rewards.config import RewardFunctionCfg
from rlserve.rewards.loader import CombinedReward, import_object

BUILTINS: dict[str, type[Environment]] = {"single_turn": SingleTurn, "guess_number": GuessNumber}


def single_turn_functions(cfg: EnvironmentCfg) -> list[RewardFunctionCfg]:
    """The reward functions a `single_turn` environment's `args.functions` names (empty: the default)."""
    extra = set(cfg.args) - {"functions"}
    if extra:
        raise ValueError(f"args: single_turn takes only `functions`, not {sorted(extra)}")
    raw = cfg.args.get("functions", [])
    if not isinstance(raw, list):
        raise ValueError("args.functions: must be a list of reward functions ({name, import_path, weight, args})")
    return [RewardFunctionCfg.model_validate(f) for f in raw]


def load_environment(cfg: EnvironmentCfg, default_reward: Callable[[], CombinedReward]) -> Environment:
    """Instantiate one environment; classes get `args` as keyword arguments.

    `single_turn` scores with the reward functions of `args.functions`, or with
    `default_reward()` (the service's deployed functions) when it names none.
    """
    if cfg.import_path is None and cfg.name == "single_turn":
        functions = single_turn_functions(cfg)
        return SingleTurn(CombinedReward(functions) if functions else default_reward())
    obj = import_object(cfg.import_path) if cfg.import_path else BUILTINS.get(cfg.name)
    if obj is None:
        raise ValueError(f"unknown environment {cfg.name!r}: not a built-in ({', '.join(BUILTINS)}) and no "
                         f"import_path given")
    if not inspect.isclass(obj) or not issubclass(obj, Environment):
        raise ValueError(f"environment {cfg.name!r}: {cfg.import_path} is not a subclass of "
                         f"rlserve.environments.interfaces.Environment")
    try:
        return obj(**cfg.args)
    except TypeError as err:
        raise ValueError(f"environment {cfg.name!r}: bad args {cfg.args}: {err}") from None
