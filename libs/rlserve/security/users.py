"""The users file: the named principals of a cluster and the digests of their tokens.

One user a line, `NAME sha256:HEXDIGEST [admin]`; blank lines and `#`
comments are skipped. Only the SHA-256 digest of a token is stored, so the
file (mode 0600, refused if other users may access it, like the token
files) never holds a usable token: `add_user` prints the new token once and
keeps its digest. The gateway re-reads the file when it changes
(`identity.TokenStore`), so adding or revoking a user needs no restart.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlserve.security.principal import Principal, Role, check_name
from rlserve.security.tokens import check_private, digest, new_token

_ADMIN_WORD = "admin"
_DIGEST_PREFIX = "sha256:"
# The Tinker SDK takes only keys that start with this (tinker/lib/_auth_token_provider.py); such a key is an
# rlserve token like any other (the gRPC endpoint takes it too).
TINKER_KEY_PREFIX = "tml-"


@dataclass(frozen=True)
class User:
    principal: Principal
    digest: bytes


def _parse_line(path: Path, lineno: int, line: str) -> User:
    where = f"{path}:{lineno}"
    words = line.split()
    if len(words) not in (2, 3) or (len(words) == 3 and words[2] != _ADMIN_WORD):
        raise ValueError(f"{where}: a user line is `NAME sha256:HEXDIGEST [admin]`")
    try:
        name = check_name(words[0])
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    hexdigest = words[1].removeprefix(_DIGEST_PREFIX)
    if not words[1].startswith(_DIGEST_PREFIX) or len(hexdigest) != 64:
        raise ValueError(f"{where}: the token digest is `sha256:` and 64 hex digits")
    try:
        token_digest = bytes.fromhex(hexdigest)
    except ValueError:
        raise ValueError(f"{where}: the token digest is `sha256:` and 64 hex digits") from None
    return User(Principal(name, Role.ADMIN if len(words) == 3 else Role.USER), token_digest)


def read_users(path: Path) -> list[User]:
    """The users in `path` (none if it does not exist). Names and digests must be unique: a file that
    could map one token to two users, or one name to two roles, is refused."""
    if not path.exists():
        return []
    check_private(path, "users file")
    users: list[User] = []
    names: set[str] = set()
    digests: set[bytes] = set()
    for lineno, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        user = _parse_line(path, lineno, line)
        if user.principal.name in names:
            raise ValueError(f"{path}:{lineno}: user {user.principal.name!r} is listed twice")
        if user.digest in digests:
            raise ValueError(f"{path}:{lineno}: this token digest is listed for another user already")
        names.add(user.principal.name)
        digests.add(user.digest)
        users.append(user)
    return users


@contextmanager
def _editing(path: Path) -> Iterator[list[str]]:
    """The file's lines, to edit in place; written back atomically (mode 0600) when the block ends. A lock
    file beside it keeps two operators' edits from losing one another."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = os.open(path.with_name(path.name + ".lock"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        read_users(path)  # refuse to edit a file that is broken or readable by others
        lines = path.read_text().splitlines() if path.exists() else []
        yield lines
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("".join(line + "\n" for line in lines))
        os.replace(tmp, path)
    finally:
        os.close(lock)


def add_user(path: Path, name: str, admin: bool, tinker: bool = False) -> str:
    """Add `name` with a new token and return the token: the only time it is shown (the file keeps its
    digest). With `tinker` the token has the form the Tinker SDK accepts (`tml-...`)."""
    check_name(name)
    token = (TINKER_KEY_PREFIX if tinker else "") + new_token()
    with _editing(path) as lines:
        if any(line.split()[:1] == [name] for line in lines):
            raise ValueError(f"user {name!r} exists already; revoke it first to give it a new token")
        lines.append(f"{name} {_DIGEST_PREFIX}{digest(token).hex()}" + (f" {_ADMIN_WORD}" if admin else ""))
    return token


def revoke_user(path: Path, name: str) -> None:
    """Remove `name`: the gateway refuses its token within about a second. Its runs go on."""
    with _editing(path) as lines:
        kept = [line for line in lines if line.split()[:1] != [name]]
        if len(kept) == len(lines):
            raise ValueError(f"no user {name!r} in {path}")
        lines[:] = kept
