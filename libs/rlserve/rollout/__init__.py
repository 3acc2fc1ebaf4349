"""Generation engines behind one contract (`interfaces`): vLLM and transformers, built by name (`registry`).

`follower.py` is a replica's side of weight sync (direct transfers from the learner,
catch-up from the weight store).
"""

from rlserve.rollout.registry import make_engine

__all__ = ["make_engine"]
