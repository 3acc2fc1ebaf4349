"""Policy training: the backend contract (`interfaces`), building one by name (`registry`), and the two backends.

`dtensor/` and `megatron/` use the same file names for the same job:
`backend.py` (the LearnerBackend), `parallel_dims.py` (the parallel layout),
`weights.py` (export to HF names for the generator) and `checkpoint.py` (the
model and optimizer state of a checkpoint whose layout `checkpoint.py` here
owns). The HF <-> Megatron parameter map is `rlserve.learner.megatron.hf_map`.
`publisher.py` is rank 0's side of weight sync (it moves data between
processes, so it imports Ray; the backends do not).
"""

from rlserve.learner.registry import make_backend

__all__ = ["make_backend"]
