"""Per-user quotas: runs at once, runs waiting, and the size of one run.

A user's quota is, key by key, their own entry over `default`, and the
quotas file's entries over the cluster file's `quotas:` section:
cluster `default` < file `default` < cluster `users.NAME` < file `users.NAME`.
The file (YAML of the same shape) is re-read when it changes, so the operator
changes a quota without a restart. Admins (and the cluster's own calls) are
not limited unless they have an entry of their own under `users`.

Over `max_queued_runs` or `max_trajectories_per_run` a SubmitRun gets
RESOURCE_EXHAUSTED naming the quota and its limit; a user at
`max_running_runs` keeps their further runs queued while other users' runs
start.
"""

from __future__ import annotations

import logging
import stat
import time
from pathlib import Path

import grpc
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rlserve.config import RunSpec
from rlserve.logs import event
from rlserve.rpc import RpcError, failed_precondition
from rlserve.security.principal import NAME, Principal

log = logging.getLogger("rlserve.coordinator")
_RECHECK_S = 1.0


class Quota(BaseModel):
    """One entry (`default` or a user's): the keys it sets; the others come from the entries below it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_running_runs: int | None = Field(None, ge=1, le=100_000)
    max_queued_runs: int | None = Field(None, ge=1, le=100_000)
    # grpo.max_num_steps x grpo.num_prompts_per_step x grpo.num_generations_per_prompt of one run.
    max_trajectories_per_run: int | None = Field(None, ge=1)


class QuotaLimits(BaseModel):
    """A user's quota with every key set. The defaults are generous: they stop a runaway client, not work
    (the spec's own bound is 1M steps x 65,536 trajectories)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_running_runs: int = 4
    max_queued_runs: int = 16
    max_trajectories_per_run: int = 100_000_000


class QuotasCfg(BaseModel):
    """The cluster file's `quotas` section, and the quotas file (same shape)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    default: Quota = Quota()
    users: dict[str, Quota] = {}

    @field_validator("users")
    @classmethod
    def _names(cls, v: dict[str, Quota]) -> dict[str, Quota]:
        bad = [name for name in v if not NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"not user names: {bad}")
        return v


def limits_of(principal: Principal, layers: list[QuotasCfg]) -> QuotaLimits | None:
    """`principal`'s quota from `layers` (lowest first); None: not limited (an admin without an entry)."""
    own = [layer.users[principal.name] for layer in layers if principal.name in layer.users]
    if principal.is_admin and not own:
        return None
    merged: dict[str, int] = {}
    for entry in [layer.default for layer in layers] + own:
        merged.update(entry.model_dump(exclude_none=True))
    return QuotaLimits(**merged)


def read_quotas_file(path: Path) -> QuotasCfg | None:
    """The quotas file (None if there is none). Refused if other users may write it."""
    if not path.exists():
        return None
    mode = path.stat().st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"{path}: other users may write this quotas file (mode {stat.S_IMODE(mode):o}); "
                         f"run `chmod 600 {path}`")
    try:
        return QuotasCfg.model_validate(yaml.safe_load(path.read_text()) or {})
    except (yaml.YAMLError, ValidationError) as err:
        raise ValueError(f"{path}: {err}") from None


class Quotas:
    """The cluster file's quotas with the quotas file's over them; the file is re-read when it changes."""

    def __init__(self, base: QuotasCfg, path: Path | None):
        self.base, self.path = base, path
        self._file: QuotasCfg | None = None
        self._stamp: tuple[int, ...] = ()
        self._error = ""
        self._checked = 0.0
        self._reload()

    def _reload(self) -> None:
        self._checked = time.monotonic()
        if self.path is None:
            return
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino, st.st_mode)
        except FileNotFoundError:
            stamp = (-1,)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self._file, self._error = read_quotas_file(self.path), ""
        except (OSError, ValueError) as err:
            self._error = str(err)  # the last good quotas stay in force for runs already queued
            event(log, "quotas.invalid", logging.WARNING, error=self._error[:500])
        else:
            event(log, "quotas.loaded", path=self.path, users=len(self._file.users) if self._file else 0)

    def limits(self, principal: Principal, strict: bool = True) -> QuotaLimits | None:
        """`principal`'s quota. strict (a new submission): a broken quotas file refuses the call, so a typo
        cannot lift a limit; otherwise (scheduling) the last good file counts."""
        if time.monotonic() - self._checked > _RECHECK_S:
            self._reload()
        if strict and self._error:
            raise failed_precondition(f"the cluster's quotas file is invalid (an operator must fix it): "
                                      f"{self._error}")
        return limits_of(principal, [self.base] + ([self._file] if self._file else []))

    def check_submit(self, principal: Principal, spec: RunSpec, queued: int) -> None:
        """RESOURCE_EXHAUSTED when one more queued run of `principal`, or this run's size, is over its quota."""
        limits = self.limits(principal)
        if limits is None:
            return
        if queued >= limits.max_queued_runs:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"quota max_queued_runs is {limits.max_queued_runs}: {queued} of your runs are queued; "
                           f"submit when one has started")
        g = spec.grpo
        size = g.max_num_steps * g.num_prompts_per_step * g.num_generations_per_prompt
        if size > limits.max_trajectories_per_run:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"quota max_trajectories_per_run is {limits.max_trajectories_per_run}: grpo.max_num_steps "
                           f"x grpo.num_prompts_per_step x grpo.num_generations_per_prompt = {g.max_num_steps} x "
                           f"{g.num_prompts_per_step} x {g.num_generations_per_prompt} = {size}")
