"""Reward plug-ins a request may name: the built-ins, and what the operator allow-listed.

A request (a run spec's `reward.functions[].import_path`, or a `Score`
request) that names code by import path would otherwise run it in the
cluster with the caller's arguments (`subprocess:Popen` ran a shell command).
Only entries of the cluster file's `reward.allowed_plugins` pass; the
operator's own paths to new code are `deploy/serve swap reward` and the
cluster file's `plugins` (names a request may use, `rlserve.registry`).

The model-backed built-ins (`reward_model`, `llm_judge`) load the folder their
`args.model` names into the reward replica: only folders the cluster file's
`reward.allowed_models` lists (or folders inside them) pass, and generated
`preset:` models.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from rlserve.catalog import MODEL_BACKED_REWARDS
from rlserve.rpc import permission_denied

ALLOW_KEY = "reward.allowed_plugins"
MODELS_KEY = "reward.allowed_models"
# The attribute a plug-in's import path names when it names none.
DEFAULT_ATTRIBUTE = "reward"


class NamedFunction(Protocol):
    """A reward function as a request describes it (`rlserve.rewards.config.RewardFunctionCfg`)."""

    name: str
    import_path: str | None
    args: Mapping[str, Any]


def normalize(import_path: str) -> str:
    """`module:attr` as written; `file.py[:attr]` with the file's absolute resolved path; attr defaults to
    `DEFAULT_ATTRIBUTE`."""
    target, _, attr = import_path.strip().partition(":")
    if target.endswith(".py"):
        target = str(Path(target).expanduser().resolve())
    return f"{target}:{attr or DEFAULT_ATTRIBUTE}"


class PluginPolicy:
    def __init__(self, allowed: Iterable[str], allowed_models: Iterable[str] = ()):
        self.allowed = frozenset(normalize(p) for p in allowed)
        self.allowed_models = tuple(Path(m).expanduser().resolve() for m in allowed_models)

    def check_function(self, field: str, function: NamedFunction) -> None:
        """A reward function a request names (`field`: where, e.g. `spec_yaml: reward.functions.0`): its
        plug-in, or the model folder of a model-backed built-in, must be allowed."""
        if function.import_path:
            self.check(f"{field}.import_path", function.import_path)
        elif function.name in MODEL_BACKED_REWARDS:
            self.check_model(f"{field}.args.model", function.args.get("model"))

    def check_model(self, field: str, model: object) -> None:
        """PERMISSION_DENIED unless `model` is a generated preset or a folder in (or inside) an allowed one."""
        if isinstance(model, str) and model.startswith("preset:"):
            return
        if isinstance(model, str) and model and "\x00" not in model and len(model) <= 4096:
            path = Path(model).expanduser().resolve()
            if any(path == root or path.is_relative_to(root) for root in self.allowed_models):
                return
        shown = repr(model)[:200]
        raise permission_denied(field, f"reward model {shown} is not allowed on this cluster; an operator can add "
                                       f"its folder to `{MODELS_KEY}` in the cluster file")

    def check(self, field: str, import_path: str) -> None:
        """PERMISSION_DENIED unless `import_path` is allow-listed (built-ins are named without one)."""
        if normalize(import_path) in self.allowed:
            return
        shown = import_path if len(import_path) <= 200 else import_path[:200] + "..."
        raise permission_denied(field, f"reward plug-in {shown!r} is not allowed on this cluster; an operator "
                                       f"can add it to `{ALLOW_KEY}` in the cluster file (built-in functions "
                                       f"need no import_path)")
