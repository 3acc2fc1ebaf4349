"""Generation engines behind one contract (`interfaces`): vLLM and transformers."""

from rlserve.rollout.registry import ENGINES, make_engine

__all__ = ["ENGINES", "make_engine"]
