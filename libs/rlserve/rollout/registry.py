"""Rollout engines by name: the rollout service's `args.engine`.

The names and where each engine lives are the catalog's (`rlserve.catalog.ROLLOUT_ENGINES`, open to
plug-ins): an entry is a callable (EngineConfig) -> RolloutEngine, imported when the engine is built.
"""

from __future__ import annotations

from rlserve.catalog import ROLLOUT_ENGINES
from rlserve.rollout.interfaces import EngineConfig, RolloutEngine


def make_engine(name: str, cfg: EngineConfig) -> RolloutEngine:
    """The engine registered as `name` on `cfg` (ValueError listing the valid names if unknown)."""
    return ROLLOUT_ENGINES.load(name)(cfg)


def transformers_engine(cfg: EngineConfig) -> RolloutEngine:
    """`engine: transformers`: the transformers batch engine, served one call at a time."""
    from rlserve.rollout.hf_engine import TransformersEngine
    from rlserve.rollout.serialized import Serialized

    return Serialized(TransformersEngine(cfg))
