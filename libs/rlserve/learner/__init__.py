"""Policy training: the backend contract (`interfaces`), building one by name (`registry`), and the two backends.

`dtensor/` and `megatron/` use the same file names for the same job:
`backend.py` (the LearnerBackend), `parallel_dims.py` (the parallel layout),
`weights.py` (export to HF names for the generator) and `checkpoint.py` (the
model and optimizer state of a checkpoint whose layout `checkpoint.py` here
owns). The HF <-> Megatron parameter map is `rlserve.learner.megatron.hf_map`.
`publisher.py` is rank 0's side of weight sync (it moves data between
processes, so it imports Ray; the backends do not).

The learner service's policy is here too: `sessions.py` (the runs' sessions,
their worker groups' fair-share turns, snapshots and healing) drives its
workers through `worker_group.py` (the `WorkerGroup` protocol: `call_all`,
`restart`, `close`), implemented by `ray_group.py` (Ray actors in a placement
group: the cluster's) and `in_process_group.py` (one rank in this process:
unit tests). Each rank is a `worker_host.WorkerHost` (a backend per run) and
publishes through `publishing.py`'s contract.
"""

from rlserve.learner.registry import make_backend

__all__ = ["make_backend"]
