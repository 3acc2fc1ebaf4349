"""The tenancy policy: the cluster file's `tenancy` section, and the answer to every limit question.

One section holds every limit on how much of the cluster one party may take, in four parts whose keys never
share a name (a user's limit and the cluster's read differently):

- `callers`: each caller (a principal's name, so all of a user's tokens share one set; the peer's address
  without authentication) at the endpoint (open streams, calls in flight, calls a second, request size) and
  at the coordinator's spec reader (its share of the reader's seconds);
- `default_user`: every user's quota on runs (unfinished runs, waiting runs, a run's size, the highest
  priority a run takes in the fair share);
- `users.NAME`: one user's quota, over `default_user` key by key (admins are not limited unless they have an
  entry of their own);
- `cluster`: every user's runs together (runs that train at once, runs waiting to start).

Whatever is over a limit is refused with `OverLimit` (RESOURCE_EXHAUSTED) before it takes anything, its
message naming the limit and its key in the section. The state that the answers count (a caller's open
streams, a user's runs) lives where it changes: `callers.Limiter` at the gateway, the run manager.
"""

from __future__ import annotations

import grpc
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlserve.config import RunSpec
from rlserve.config.section import MAX_PRIORITY
from rlserve.rpc import RpcError
from rlserve.security.principal import NAME, Principal

# Runs training at once, at most (each holds a learner session and its rollout adapter).
MAX_TRAINING_RUNS = 64


class OverLimit(RpcError):
    """A call, a spec or a run over a limit: RESOURCE_EXHAUSTED, the message naming the limit's key."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    def __reduce__(self):  # keep the type across Ray's pickling
        return (type(self), (self.message,))


class CallerLimits(BaseModel):
    """`tenancy.callers`: what one caller may take of the endpoint and of the spec reader. The defaults serve a
    team's clients with room to spare; a run spec reads in ~3 ms, so no one who submits runs meets the share."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # WatchRun streams open at once.
    max_streams: int = Field(16, ge=1, le=100_000)
    # Unary calls at once.
    max_calls_in_flight: int = Field(32, ge=1, le=100_000)
    # Calls a second (unary and streams alike), the rate of a token bucket.
    calls_per_s: float = Field(50.0, gt=0, le=1e6)
    # Calls a caller makes back to back before `calls_per_s` holds it back: the bucket's size.
    call_burst: int = Field(100, ge=1, le=1_000_000)
    # A public RPC's request, at most (internal ones, admin-only, carry training batches).
    max_request_kb: int = Field(512, ge=1, le=1_048_576)
    # Seconds of the coordinator's spec reader a second (the rate of a token bucket): a caller over it waits
    # its turn, every other caller's specs read before its next one.
    spec_reading_share: float = Field(0.1, gt=0, le=1)
    # Seconds of reading a caller takes back to back before its share holds it back: the bucket's size.
    spec_reading_burst_s: float = Field(2.0, gt=0, le=3600)
    # A spec that waited this long for its caller's share is refused.
    spec_reading_max_wait_s: float = Field(30.0, gt=0, le=3600)

    def check_request_size(self, request_bytes: int) -> None:
        if request_bytes > self.max_request_kb * 1024:
            raise OverLimit(f"the request is {request_bytes // 1024} KiB; this endpoint takes at most "
                            f"{self.max_request_kb} KiB (tenancy.callers.max_request_kb)")

    def check_call(self, streaming: bool, streams: int, in_flight: int, tokens: float) -> None:
        """One more call of a caller with `streams` open, `in_flight` unary calls and `tokens` in its bucket."""
        if tokens < 1:
            raise OverLimit(f"more than {self.calls_per_s:g} calls per second (tenancy.callers.calls_per_s, bursts "
                            f"of tenancy.callers.call_burst {self.call_burst}); slow down")
        if streaming and streams >= self.max_streams:
            raise OverLimit(f"{streams} streams open; at most {self.max_streams} at once "
                            f"(tenancy.callers.max_streams)")
        if not streaming and in_flight >= self.max_calls_in_flight:
            raise OverLimit(f"{in_flight} calls in flight; at most {self.max_calls_in_flight} at once "
                            f"(tenancy.callers.max_calls_in_flight)")

    def spec_waited_too_long(self) -> OverLimit:
        return OverLimit(
            f"your spec waited {self.spec_reading_max_wait_s:g} s for your share of the coordinator's spec reader "
            f"({self.spec_reading_share:g} s of reading a second, in bursts of {self.spec_reading_burst_s:g} s; a "
            f"run spec takes ~3 ms): your specs before it took that long to read; the cluster file's "
            f"tenancy.callers.spec_reading_share sets the share")


class UserQuota(BaseModel):
    """`tenancy.default_user`: every user's quota unless their own entry says otherwise. The defaults stop a
    runaway client, not work."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The user's runs not finished yet (queued or running).
    max_unfinished_runs: int = Field(8, ge=1, le=100_000)
    # Of those, the ones waiting to start.
    max_waiting_runs: int = Field(8, ge=1, le=100_000)
    # The trajectories one run generates (`samples_of`).
    max_samples_per_run: int = Field(100_000_000, ge=1)
    # The highest `priority` a run of theirs takes in the cluster's fair share (a user may always lower theirs).
    max_priority: float = Field(1.0, gt=0, le=MAX_PRIORITY)


class UserQuotaOverride(BaseModel):
    """A `tenancy.users.NAME` entry: the keys it sets override `default_user`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Unset: `default_user`'s.
    max_unfinished_runs: int | None = Field(None, ge=1, le=100_000)
    # Unset: `default_user`'s.
    max_waiting_runs: int | None = Field(None, ge=1, le=100_000)
    # Unset: `default_user`'s.
    max_samples_per_run: int | None = Field(None, ge=1)
    # Unset: `default_user`'s.
    max_priority: float | None = Field(None, gt=0, le=MAX_PRIORITY)


class ClusterLimits(BaseModel):
    """`tenancy.cluster`: what the cluster holds, every user's runs together."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Runs that train at once. Only LoRA runs on the deployed base (no SFT warm start) train together: they
    # share the rollout engines (each run's adapter beside the others', batched by vLLM) and the learner's
    # workers (one frozen base); any other run trains alone. The rollout needs `enable_lora` (and `max_loras`).
    max_training_runs: int = Field(4, ge=1, le=MAX_TRAINING_RUNS)
    # Runs waiting to start (their preflight, or their turn), every user's together.
    queue_capacity: int = Field(64, ge=1, le=100_000)


class UserLimits(BaseModel):
    """One user's quota in force, and which of its keys their own entry sets (for messages naming the key)."""

    model_config = ConfigDict(frozen=True)

    values: UserQuota
    user: str
    own: frozenset[str]

    def key(self, name: str) -> str:
        return f"tenancy.users.{self.user}.{name}" if name in self.own else f"tenancy.default_user.{name}"


def samples_of(spec: RunSpec) -> tuple[int, str]:
    """The trajectories a run generates, and how (for messages)."""
    g = spec.grpo
    size = g.max_num_steps * g.num_prompts_per_step * g.num_generations_per_prompt
    return size, (f"grpo.max_num_steps x grpo.num_prompts_per_step x grpo.num_generations_per_prompt = "
                  f"{g.max_num_steps} x {g.num_prompts_per_step} x {g.num_generations_per_prompt} = {size}")


class TenancyPolicy(BaseModel):
    """The cluster file's `tenancy` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Each caller at the endpoint and at the coordinator's spec reader (applies at `deploy/serve up`).
    callers: CallerLimits = CallerLimits()
    # Every user's quota on runs (re-read live, like `users` and `cluster`).
    default_user: UserQuota = UserQuota()
    # A user's own quota, by name, over `default_user` key by key; an admin listed here is limited too.
    users: dict[str, UserQuotaOverride] = {}
    # Every user's runs together.
    cluster: ClusterLimits = ClusterLimits()

    @field_validator("users")
    @classmethod
    def _names(cls, v: dict[str, UserQuotaOverride]) -> dict[str, UserQuotaOverride]:
        bad = [name for name in v if not NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"not user names: {bad}")
        return v

    def limits_of(self, principal: Principal) -> UserLimits | None:
        """`principal`'s quota; None: not limited (an admin without an entry of their own)."""
        own = self.users.get(principal.name)
        if own is None:
            return None if principal.is_admin else UserLimits(values=self.default_user, user=principal.name,
                                                              own=frozenset())
        overrides = own.model_dump(exclude_none=True)
        return UserLimits(values=self.default_user.model_copy(update=overrides), user=principal.name,
                          own=frozenset(overrides))

    def check_queue(self, queued: int) -> None:
        """One more run beside the `queued` runs (every user's) waiting to start."""
        if queued >= self.cluster.queue_capacity:
            raise OverLimit(f"{queued} runs are queued already, the most this cluster holds "
                            f"(tenancy.cluster.queue_capacity); submit when some have started")

    def may_train_beside(self, training: int) -> bool:
        """Whether a run that may train together with others (LoRA on the deployed base) starts beside the
        `training` runs that do."""
        return training < self.cluster.max_training_runs

    def check_submit(self, principal: Principal, spec: RunSpec, unfinished: int, waiting: int) -> None:
        """One more run of `principal` (`unfinished` of theirs are queued or running, `waiting` of those wait
        to start), and this run's size and priority, within their quota."""
        limits = self.limits_of(principal)
        if limits is None:
            return
        q = limits.values
        if unfinished >= q.max_unfinished_runs:
            raise OverLimit(f"quota max_unfinished_runs ({limits.key('max_unfinished_runs')}) is "
                            f"{q.max_unfinished_runs}: {unfinished} of your runs are queued or running; submit "
                            f"when one has finished")
        if waiting >= q.max_waiting_runs:
            raise OverLimit(f"quota max_waiting_runs ({limits.key('max_waiting_runs')}) is {q.max_waiting_runs}: "
                            f"{waiting} of your runs are waiting to start; submit when one has started")
        size, how = samples_of(spec)
        if size > q.max_samples_per_run:
            raise OverLimit(f"quota max_samples_per_run ({limits.key('max_samples_per_run')}) is "
                            f"{q.max_samples_per_run}: spec_yaml: {how}")
        if spec.priority > q.max_priority:
            raise OverLimit(f"quota max_priority ({limits.key('max_priority')}) is {q.max_priority:g}: "
                            f"spec_yaml: priority is {spec.priority:g}")
