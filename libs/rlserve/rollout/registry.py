"""The one place rollout engines are chosen by name."""

from __future__ import annotations

from rlserve.rollout.interfaces import EngineConfig, RolloutEngine


def _vllm(cfg: EngineConfig) -> RolloutEngine:
    from rlserve.rollout.vllm_engine import VllmEngine

    return VllmEngine(cfg)


def _transformers(cfg: EngineConfig) -> RolloutEngine:
    from rlserve.rollout.hf_engine import TransformersEngine
    from rlserve.rollout.serialized import Serialized

    return Serialized(TransformersEngine(cfg))


ENGINES = {"vllm": _vllm, "transformers": _transformers}


def make_engine(name: str, cfg: EngineConfig) -> RolloutEngine:
    try:
        factory = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown rollout engine {name!r}; valid engines: {', '.join(ENGINES)}") from None
    return factory(cfg)
