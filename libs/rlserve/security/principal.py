"""Who a call runs as: a named principal with a role.

The gateway resolves the bearer token to a principal (`identity.TokenStore`)
and forwards it with every run-facing call; the coordinator scopes runs,
quotas and the paths a spec may name to it. Events and logs name the
principal, never the token. The single-token files of earlier clusters keep
working as the principals `user` (the `token` file) and `admin` (the
`admin_token` file); a call that arrives without a principal comes from
inside the cluster (or through an endpoint with `auth: none`) and runs as
`system`, an admin.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Role(enum.IntEnum):
    """USER reaches the run-facing RPCs for its own runs; ADMIN every run, and the internal services when
    the cluster exposes them."""

    USER = 1
    ADMIN = 2


# A principal's name is a short folder-safe word (it starts the ids of its runs: `alice.exp1`).
NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
# The principals of the single-token files; runs recorded before owners existed belong to LEGACY_USER.
LEGACY_USER = "user"
LEGACY_ADMIN = "admin"
SYSTEM_NAME = "system"
RESERVED_NAMES = frozenset({LEGACY_USER, LEGACY_ADMIN, SYSTEM_NAME})


def check_name(name: str) -> str:
    """`name` if it can name a user of the users file, else ValueError saying what a name is."""
    if not NAME.fullmatch(name):
        raise ValueError(f"{name[:40]!r}: a user name is 1-32 lower-case letters, digits, '-' or '_', "
                         f"starting with a letter")
    if name in RESERVED_NAMES:
        raise ValueError(f"{name!r} is reserved: `user` and `admin` are the principals of the token files, "
                         f"`system` the cluster's own calls")
    return name


@dataclass(frozen=True)
class Principal:
    name: str
    role: Role

    @property
    def is_admin(self) -> bool:
        return self.role >= Role.ADMIN

    def may_access(self, owner: str) -> bool:
        """Whether this principal may see and act on a run `owner` owns."""
        return self.is_admin or owner == self.name


SYSTEM = Principal(SYSTEM_NAME, Role.ADMIN)
