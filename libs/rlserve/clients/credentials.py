"""How a client finds the token (and the CA) of the endpoint it talks to.

`deploy/serve up` writes a small record per endpoint in the user's config
folder (`$RLSERVE_CONFIG_DIR`, default `~/.config/rlserve`) naming the
cluster's token file and, with TLS, the certificate to trust; the record
holds paths, never a token. A client takes, in order: the token in
`RLSERVE_TOKEN`, the file given with `--token-file` (or `RLSERVE_TOKEN_FILE`),
then the record's file; and `--ca-file` (or `RLSERVE_CA_FILE`), then the
record's certificate.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import grpc

from rlserve.security.tokens import read_tokens

CONFIG_DIR_ENV = "RLSERVE_CONFIG_DIR"
TOKEN_ENV = "RLSERVE_TOKEN"
TOKEN_FILE_ENV = "RLSERVE_TOKEN_FILE"
CA_FILE_ENV = "RLSERVE_CA_FILE"


def config_dir() -> Path:
    return Path(os.environ.get(CONFIG_DIR_ENV) or Path.home() / ".config" / "rlserve")


def record_path(endpoint: str) -> Path:
    return config_dir() / "endpoints" / (re.sub(r"[^A-Za-z0-9._-]", "_", endpoint) + ".json")


def write_record(endpoint: str, token_file: Path | None, ca_file: Path | None) -> Path:
    """Remember where this endpoint's token file and CA are (mode 0600, folder 0700)."""
    path = record_path(endpoint)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"endpoint": endpoint, "token_file": str(token_file) if token_file else None,
                   "ca_file": str(ca_file) if ca_file else None}, f)
    tmp.replace(path)
    return path


@dataclass(frozen=True)
class Credentials:
    token: str | None = None
    ca_file: Path | None = None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel(self, endpoint: str) -> grpc.Channel:
        if self.ca_file is None:
            return grpc.insecure_channel(endpoint)
        return grpc.secure_channel(endpoint, grpc.ssl_channel_credentials(self.ca_file.read_bytes()))


def _record(endpoint: str) -> dict:
    path = record_path(endpoint)
    return json.loads(path.read_text()) if path.is_file() else {}


def find_credentials(endpoint: str, token_file: Path | None = None, ca_file: Path | None = None) -> Credentials:
    """The token and CA for `endpoint` (see the module docstring for the order)."""
    record = _record(endpoint)
    token = os.environ.get(TOKEN_ENV) or None
    if token is None:
        source = token_file or os.environ.get(TOKEN_FILE_ENV) or record.get("token_file")
        token = read_tokens(Path(source))[0] if source else None
    ca = ca_file or os.environ.get(CA_FILE_ENV) or record.get("ca_file")
    return Credentials(token, Path(ca) if ca else None)
