"""Tenancy: who may use how much of a shared cluster, in one place.

- `policy`: the cluster file's `tenancy` section (`TenancyPolicy`: `callers`, `default_user`, `users`,
  `cluster`) and the answer to every limit question, `OverLimit` (RESOURCE_EXHAUSTED naming the key) when over;
- `token_bucket`: the one token bucket, for every limit on a rate;
- `callers`: each caller's share of the endpoint, counted at the gateway;
- `live`: the policy in force at the coordinator, re-read when the cluster file changes;
- `legacy`: the limits' old keys, still read, each named with its new key;
- `fair_share`: each run's share of the engines and the learner, by its priority (capped by its user's
  `max_priority`).

The spec reader (`rlserve.runs.spec_reader`) and the run manager (`rlserve.runs.manager`) hold the state that
their limits count and ask the policy.
"""
