"""Who holds a bearer token: the principals of the token files and of the users file.

Tokens are compared as SHA-256 digests with `hmac.compare_digest` against every
stored digest (no early exit), so the time a check takes does not tell how much
of a guess was right nor which token matched. Files are re-read when they
change (checked at most once a second), so a user or a token can be added or
revoked without restarting anything; a file that becomes unreadable or invalid
holds no tokens until it is fixed (fail closed).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlserve.logs import event
from rlserve.security.principal import LEGACY_ADMIN, LEGACY_USER, Principal, Role
from rlserve.security.tokens import digest, read_tokens
from rlserve.security.users import read_users

log = logging.getLogger("rlserve.gateway")
_RECHECK_S = 1.0
# The principals of the single-token files of earlier clusters.
_LEGACY = {Role.USER: Principal(LEGACY_USER, Role.USER), Role.ADMIN: Principal(LEGACY_ADMIN, Role.ADMIN)}

Entries = list[tuple[bytes, Principal]]


@dataclass
class _Source:
    path: Path
    read: Callable[[Path], Entries]
    stamp: tuple[int, ...] = ()
    entries: Entries = field(default_factory=list)

    def load(self) -> None:
        """Re-read the file if it changed (a users file that does not exist yet holds no one)."""
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino, st.st_mode)
        except FileNotFoundError:
            stamp = (-1,)
        if stamp != self.stamp:
            self.stamp = stamp
            try:
                self.entries = self.read(self.path)
            except Exception:
                self.entries = []  # fail closed until the file changes again
                raise


def _token_file(principal: Principal) -> Callable[[Path], Entries]:
    return lambda path: [(digest(t), principal) for t in read_tokens(path)]


def _users_file(path: Path) -> Entries:
    return [(u.digest, u.principal) for u in read_users(path)]


class TokenStore:
    """Principals by token: the single-token files by role (`user`, `admin`) and the users file, if any."""

    def __init__(self, token_files: dict[Role, Path], users_file: Path | None = None):
        self._sources = [_Source(path, _token_file(_LEGACY[role])) for role, path in token_files.items()]
        if users_file is not None:
            self._sources.append(_Source(users_file, _users_file))
        for src in self._sources:  # at start a bad file is an error, not an endpoint nobody can use
            src.load()
        self._checked = time.monotonic()

    def reload(self) -> None:
        """Re-read changed files. A file that became unreadable or invalid keeps no tokens (fail closed)."""
        for src in self._sources:
            try:
                src.load()
            except (OSError, ValueError) as err:  # said once per change of the file
                event(log, "gateway.credentials_invalid", logging.ERROR, path=src.path, error=str(err)[:300],
                      effect="no token of this file is accepted until it is fixed")
        self._checked = time.monotonic()

    def principal_of(self, token: str | None) -> Principal | None:
        """The principal `token` belongs to, or None. Every stored digest is compared; should two files hold
        the same token, the higher role wins (then the earlier file). A token no file held at the last look is
        looked up again after a fresh look (a stat of each file): a key issued a moment ago works at once,
        as a client given it expects, while a revoked one stops within `_RECHECK_S`."""
        if time.monotonic() - self._checked > _RECHECK_S:
            self.reload()
        if token is None:
            return None
        presented = digest(token)
        found = self._lookup(presented)
        if found is None:
            self.reload()
            found = self._lookup(presented)
        return found

    def _lookup(self, presented: bytes) -> Principal | None:
        best: Principal | None = None
        for src in self._sources:
            for stored, principal in src.entries:
                if hmac.compare_digest(stored, presented) and (best is None or principal.role > best.role):
                    best = principal
        return best
