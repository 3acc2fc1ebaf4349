"""The tenancy policy in force at the coordinator: the one it was deployed with, then its cluster file's.

The coordinator re-reads the cluster file's `tenancy` section (its old keys too, each logged as deprecated)
when the file changes, checked at most once a second, so an operator changes a user's quota or the cluster's
limits by editing the file, with no restart. A file that no longer parses, or that gives one limit twice,
leaves the last good policy in force (a typo never lifts a limit) and says so in the coordinator's log.
The run manager asks the policy at every submit and every start, so `default_user`, `users` and `cluster`
apply within a second; `callers` apply when the gateway and the coordinator are deployed again
(`deploy/serve up`): the gateway does not read the file.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import yaml
from pydantic import ValidationError

from rlserve.logs import event
from rlserve.tenancy.legacy import CLUSTER_FILE, LegacyKeyError, log_deprecated, migrate
from rlserve.tenancy.policy import TenancyPolicy

log = logging.getLogger("rlserve.coordinator")
_RECHECK_S = 1.0


def read_policy(cluster_file: Path) -> tuple[TenancyPolicy, dict[str, str]]:
    """The `tenancy` section of a cluster file with its old keys moved in (the rest of the file is
    `deploy/serve`'s), and those old keys with their new ones. ValueError: not a valid section."""
    try:
        data = yaml.safe_load(cluster_file.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError("not a mapping")
        data, moved = migrate(data, CLUSTER_FILE)
        return TenancyPolicy.model_validate(data.get("tenancy") or {}), moved
    except (yaml.YAMLError, ValidationError, LegacyKeyError) as err:
        raise ValueError(str(err)) from None


class LiveTenancy:
    """The policy in force: `deployed`, then `cluster_file`'s as it changes (None: `deployed` stays)."""

    def __init__(self, deployed: TenancyPolicy, cluster_file: Path | None = None):
        self.policy, self.path = deployed, cluster_file
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
            self.policy, moved = read_policy(self.path)
        except (OSError, ValueError) as err:
            # The last good policy stays in force: a broken edit must not lift a limit.
            event(log, "tenancy.invalid", logging.WARNING, path=self.path, error=str(err)[:500])
        else:
            log_deprecated(log, str(self.path), moved)
            event(log, "tenancy.loaded", path=self.path, users=len(self.policy.users))

    def current(self) -> TenancyPolicy:
        if time.monotonic() - self._checked > _RECHECK_S:
            self._reload()
        return self.policy
