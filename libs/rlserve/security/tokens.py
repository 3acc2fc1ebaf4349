"""Bearer tokens of the public endpoint: making them, the single-token files, the header.

The files `deploy/serve up` creates (`token`, `admin_token`) hold raw tokens,
one a line, in files the operator owns; the users file (`users.py`) holds
only digests. `identity.TokenStore` reads both and resolves a token to its
principal.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from pathlib import Path

# 32 random bytes, URL-safe base64: 43 characters.
MIN_TOKEN_CHARS = 32


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


def check_private(path: Path, what: str) -> None:
    """Like ssh with private keys: a file of credentials that other users may read or write is refused."""
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{path}: other users may access this {what} (mode {stat.S_IMODE(mode):o}); "
                         f"run `chmod 600 {path}`")


def read_tokens(path: Path) -> list[str]:
    """The tokens in `path`: one a line; blank lines and `#` comments are skipped."""
    if not path.exists():
        raise ValueError(f"{path}: no such token file")
    check_private(path, "token file")
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
