"""Load an environment by name (`rlserve.catalog.ENVIRONMENTS`: the built-ins and the cluster's enabled
plug-ins) or by import path; `Environments` is the service's cache of them, behind the plug-in allow-list."""

from __future__ import annotations

import hashlib
import inspect
import threading
from collections import OrderedDict
from collections.abc import Callable

from rlserve.catalog import ENVIRONMENTS
from rlserve.environments.config import SCORED, BadEnvironment, EnvironmentCfg
from rlserve.environments.interfaces import Environment
from rlserve.registry import import_object
from rlserve.rewards.config import RewardFunctionCfg
from rlserve.rewards.loader import CombinedReward
from rlserve.rpc import invalid_argument
from rlserve.security.plugins import PluginPolicy
from rlserve.v1 import environment_pb2


def single_turn_functions(cfg: EnvironmentCfg) -> list[RewardFunctionCfg]:
    """The reward functions a built-in that scores (`SCORED`) names in `args.functions` (empty: the default)."""
    extra = set(cfg.args) - {"functions"} - SCORED[cfg.name]
    if extra:
        raise ValueError(f"args: {cfg.name} takes only {sorted({'functions'} | SCORED[cfg.name])}, not {sorted(extra)}")
    raw = cfg.args.get("functions", [])
    if not isinstance(raw, list):
        raise ValueError("args.functions: must be a list of reward functions ({name, import_path, weight, args})")
    return [RewardFunctionCfg.model_validate(f) for f in raw]


def load_environment(cfg: EnvironmentCfg, default_reward: Callable[[], CombinedReward]) -> Environment:
    """Instantiate one environment; classes get `args` as keyword arguments.

    The built-ins that score (`SCORED`: single_turn, tool_use) are built with the
    reward functions of `args.functions` first, or with `default_reward()` (the
    service's deployed functions) when it names none.
    """
    if cfg.import_path is None and cfg.name in SCORED:
        functions = single_turn_functions(cfg)
        reward = CombinedReward(functions) if functions else default_reward()
        try:
            return ENVIRONMENTS.load(cfg.name)(reward, **{k: v for k, v in cfg.args.items() if k != "functions"})
        except TypeError as err:
            raise ValueError(f"environment {cfg.name!r}: bad args {cfg.args}: {err}") from None
    path = cfg.import_path or ENVIRONMENTS[cfg.name]
    obj = import_object(path)
    if not inspect.isclass(obj) or not issubclass(obj, Environment):
        raise ValueError(f"environment {cfg.name!r}: {path} is not a subclass of "
                         f"rlserve.environments.interfaces.Environment")
    try:
        return obj(**cfg.args)
    except TypeError as err:
        raise ValueError(f"environment {cfg.name!r}: bad args {cfg.args}: {err}") from None


class Environments:
    """The environments Reset and Step requests name, each loaded once per description (the
    service's side): plug-ins by import path, the environment's own or its reward functions', must
    be on the operator's allow-list (PERMISSION_DENIED); a description that loads no environment is
    INVALID_ARGUMENT. The version string names the description and the default reward functions."""

    def __init__(self, plugins: PluginPolicy, default_reward: CombinedReward, max_loaded: int = 32):
        self.plugins, self.default_reward, self.max_loaded = plugins, default_reward, max_loaded
        self._loaded: OrderedDict[str, tuple[Environment, str]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, spec: environment_pb2.EnvironmentSpec) -> tuple[Environment, str]:
        try:
            cfg = EnvironmentCfg.from_proto(spec)
        except BadEnvironment as err:
            raise invalid_argument(f"environment.{err.field}", err.problem) from None
        if cfg.import_path:
            self.plugins.check("environment.import_path", cfg.import_path)
        try:
            if cfg.import_path is None and cfg.name in SCORED:
                for i, f in enumerate(single_turn_functions(cfg)):
                    if f.import_path:
                        self.plugins.check(f"environment.args_json: functions.{i}.import_path", f.import_path)
            key = cfg.key()
            with self._lock:
                if key in self._loaded:
                    self._loaded.move_to_end(key)
                    return self._loaded[key]
            env = load_environment(cfg, lambda: self.default_reward)
        except ValueError as err:
            raise invalid_argument("environment", str(err)) from None
        version = hashlib.sha1(f"{key}\n{self.default_reward.version}".encode()).hexdigest()[:12]
        with self._lock:
            self._loaded[key] = (env, version)
            while len(self._loaded) > self.max_loaded:
                self._loaded.popitem(last=False)
        return env, version
