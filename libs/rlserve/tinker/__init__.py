"""The Tinker training API on an rlserve cluster: the wire of the `tinker` SDK (0.38), served under `/api/v1`
of the gateway's HTTP listener (`rlserve.gateway.http`), so that an unmodified SDK and cookbook train on
the user's own cluster.

- `wire`: the SDK's bodies (JSON; `forward_backward` as the SDK's own protobuf, zstd when compressed) to
  rlserve's types and back, every client mistake a `UserError` naming its field;
- `futures`: the futures every call answers with, `retrieve_future`'s "try again" with the queue state,
  and the seq-id order and idempotency of a model's calls;
- `service`: sessions, models (a LoRA adapter each, of any rank, on a base the cluster maps from a name),
  samplers and `tinker://` checkpoints of a user, over a `Trainer` (the learner's primitives) and a
  `Sampler` (a rollout engine);
- `api`: the routes (`HttpApi`).

docs/tinker.md is the user's page.
"""
