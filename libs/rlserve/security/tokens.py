"""Bearer tokens of the public endpoint, kept in files the operator owns (one token a line).

Tokens are compared as SHA-256 digests with `hmac.compare_digest` against every
stored digest (no early exit), so the time a check takes does not tell how much
of a guess was right nor which token matched. Files are re-read when they
change, so a token can be added or revoked without restarting anything.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import secrets
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

# 32 random bytes, URL-safe base64: 43 characters.
MIN_TOKEN_CHARS = 32
_RECHECK_S = 1.0


class Role(enum.IntEnum):
    """USER reaches the run-facing RPCs; ADMIN also the internal services (when exposed)."""

    USER = 1
    ADMIN = 2


def new_token() -> str:
    return secrets.token_urlsafe(32)


def ensure_token_file(path: Path) -> bool:
    """Create `path` (mode 0600, parent 0700) holding a new token unless it exists; True if created."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(new_token() + "\n")
    return True


def read_tokens(path: Path) -> list[str]:
    """The tokens in `path`: one a line; blank lines and `#` comments are skipped.

    Like ssh with private keys, a file that other users may read or write is refused.
    """
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ValueError(f"{path}: no such token file") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{path}: other users may access this token file (mode {stat.S_IMODE(mode):o}); "
                         f"run `chmod 600 {path}`")
    tokens = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if len(line) < MIN_TOKEN_CHARS or any(c.isspace() for c in line):
            raise ValueError(f"{path}:{lineno}: a token is one word of at least {MIN_TOKEN_CHARS} characters")
        tokens.append(line)
    if not tokens:
        raise ValueError(f"{path}: no tokens")
    return tokens


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def bearer_token(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
    """The token of an `authorization: Bearer TOKEN` entry, or None."""
    for key, value in metadata or ():
        if key.lower() == "authorization" and isinstance(value, str):
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


@dataclass
class _Source:
    role: Role
    path: Path
    stamp: tuple[int, ...] = ()
    digests: list[bytes] = field(default_factory=list)


class TokenStore:
    """Tokens by role, from files; `role_of` re-reads a file that changed (checked once a second)."""

    def __init__(self, files: dict[Role, Path]):
        self._sources = [_Source(role, path) for role, path in files.items()]
        for src in self._sources:  # at start a bad file is an error, not an endpoint nobody can use
            self._load(src)
        self._checked = time.monotonic()

    @staticmethod
    def _load(src: _Source) -> None:
        try:
            st = src.path.stat()
        except FileNotFoundError:
            raise ValueError(f"{src.path}: no such token file") from None
        stamp = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino, st.st_mode)
        if stamp != src.stamp:
            src.digests = [digest(t) for t in read_tokens(src.path)]
            src.stamp = stamp

    def reload(self) -> None:
        """Re-read changed files. A file that became unreadable or invalid keeps no tokens (fail closed)."""
        for src in self._sources:
            try:
                self._load(src)
            except (OSError, ValueError):
                src.digests, src.stamp = [], ()
        self._checked = time.monotonic()

    def role_of(self, token: str | None) -> Role | None:
        if time.monotonic() - self._checked > _RECHECK_S:
            self.reload()
        if token is None:
            return None
        presented = digest(token)
        best: Role | None = None
        for src in self._sources:
            for stored in src.digests:
                if hmac.compare_digest(stored, presented) and (best is None or src.role > best):
                    best = src.role
        return best
