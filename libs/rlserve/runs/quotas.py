"""Per-user quotas: how many runs a user holds at once, how many of them wait, and how big one run is.

They live in the cluster file's `quotas` section: `default` for every user,
`users.NAME` entries over it key by key. Admins (and the cluster's own calls)
are not limited unless they have an entry of their own. The coordinator
re-reads the section when the cluster file changes (checked at most once a
second), so an operator changes a quota by editing the file, with no restart;
a file that no longer parses leaves the last good quotas in force (a typo
never lifts a limit) and says so in the coordinator's log.

A SubmitRun (a resume too) over a quota gets RESOURCE_EXHAUSTED naming the
quota and the cluster-file key that sets it:

- `max_concurrent_runs`: the user's runs not finished yet (queued or running);
- `max_queued_runs`: of those, the ones waiting to start;
- `max_samples_per_run`: `grpo.max_num_steps x grpo.num_prompts_per_step x
  grpo.num_generations_per_prompt`, the trajectories the run generates;
- `max_priority`: the highest `priority` the user's runs may take in the
  cluster's fair share (1 by default: every run an equal share; a user may
  always lower their own).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rlserve.config import RunSpec
from rlserve.config.section import MAX_PRIORITY
from rlserve.logs import event
from rlserve.rpc import RpcError
from rlserve.security.principal import NAME, Principal

log = logging.getLogger("rlserve.coordinator")
_RECHECK_S = 1.0


class QuotaLimits(BaseModel):
    """The `default` entry: every user's quota unless their own entry says otherwise. The defaults stop a
    runaway client, not work."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_concurrent_runs: int = Field(8, ge=1, le=100_000)
    max_queued_runs: int = Field(8, ge=1, le=100_000)
    max_samples_per_run: int = Field(100_000_000, ge=1)
    max_priority: float = Field(1.0, gt=0, le=MAX_PRIORITY)


class UserQuota(BaseModel):
    """A `users.NAME` entry: the keys it sets override `default`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_concurrent_runs: int | None = Field(None, ge=1, le=100_000)
    max_queued_runs: int | None = Field(None, ge=1, le=100_000)
    max_samples_per_run: int | None = Field(None, ge=1)
    max_priority: float | None = Field(None, gt=0, le=MAX_PRIORITY)


class QuotasCfg(BaseModel):
    """The cluster file's `quotas` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    default: QuotaLimits = QuotaLimits()
    users: dict[str, UserQuota] = {}

    @field_validator("users")
    @classmethod
    def _names(cls, v: dict[str, UserQuota]) -> dict[str, UserQuota]:
        bad = [name for name in v if not NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"not user names: {bad}")
        return v

    def limits(self, principal: Principal) -> UserLimits | None:
        """`principal`'s quota; None: not limited (an admin without an entry of their own)."""
        own = self.users.get(principal.name)
        if own is None:
            return None if principal.is_admin else UserLimits(self.default, {})
        overrides = own.model_dump(exclude_none=True)
        return UserLimits(self.default.model_copy(update=overrides), {k: principal.name for k in overrides})


@dataclass(frozen=True)
class UserLimits:
    values: QuotaLimits
    # Keys set by the user's own entry (the others are `default`'s): for messages that name the key.
    own: dict[str, str]

    def key(self, name: str) -> str:
        return f"quotas.users.{self.own[name]}.{name}" if name in self.own else f"quotas.default.{name}"


def samples_of(spec: RunSpec) -> tuple[int, str]:
    """The trajectories a run generates, and how (for messages)."""
    g = spec.grpo
    size = g.max_num_steps * g.num_prompts_per_step * g.num_generations_per_prompt
    return size, (f"grpo.max_num_steps x grpo.num_prompts_per_step x grpo.num_generations_per_prompt = "
                  f"{g.max_num_steps} x {g.num_prompts_per_step} x {g.num_generations_per_prompt} = {size}")


def read_quotas(cluster_file: Path) -> QuotasCfg:
    """The `quotas` section of a cluster file (the rest of the file is `deploy/serve`'s)."""
    try:
        data = yaml.safe_load(cluster_file.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError("not a mapping")
        return QuotasCfg.model_validate(data.get("quotas") or {})
    except (yaml.YAMLError, ValidationError) as err:
        raise ValueError(str(err)) from None


class Quotas:
    """The quotas in force: those the coordinator was deployed with, then the cluster file's as it changes."""

    def __init__(self, deployed: QuotasCfg, cluster_file: Path | None):
        self.cfg, self.path = deployed, cluster_file
        self._stamp: tuple[int, ...] = ()
        self._checked = 0.0
        self._reload()

    def _reload(self) -> None:
        self._checked = time.monotonic()
        if self.path is None:
            return
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
        except OSError:
            stamp = (-1,)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self.cfg = read_quotas(self.path)
        except (OSError, ValueError) as err:
            # The last good quotas stay in force: a broken edit must not lift a limit.
            event(log, "quotas.invalid", logging.WARNING, path=self.path, error=str(err)[:500])
        else:
            event(log, "quotas.loaded", path=self.path, users=len(self.cfg.users))

    def current(self) -> QuotasCfg:
        if time.monotonic() - self._checked > _RECHECK_S:
            self._reload()
        return self.cfg

    def check_submit(self, principal: Principal, spec: RunSpec, unfinished: int, queued: int) -> None:
        """RESOURCE_EXHAUSTED when one more run of `principal` (`unfinished` of theirs are queued or running,
        `queued` waiting), or this run's size, is over their quota."""
        limits = self.current().limits(principal)
        if limits is None:
            return
        q = limits.values
        if unfinished >= q.max_concurrent_runs:
            raise _exhausted(f"quota max_concurrent_runs ({limits.key('max_concurrent_runs')}) is "
                             f"{q.max_concurrent_runs}: {unfinished} of your runs are queued or running; submit "
                             f"when one has finished")
        if queued >= q.max_queued_runs:
            raise _exhausted(f"quota max_queued_runs ({limits.key('max_queued_runs')}) is {q.max_queued_runs}: "
                             f"{queued} of your runs are waiting to start; submit when one has started")
        size, how = samples_of(spec)
        if size > q.max_samples_per_run:
            raise _exhausted(f"quota max_samples_per_run ({limits.key('max_samples_per_run')}) is "
                             f"{q.max_samples_per_run}: spec_yaml: {how}")
        if spec.priority > q.max_priority:
            raise _exhausted(f"quota max_priority ({limits.key('max_priority')}) is {q.max_priority:g}: "
                             f"spec_yaml: priority is {spec.priority:g}")


def _exhausted(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
