"""The users file: named principals and the digests of their tokens, edited by `deploy/serve users`,
read (and re-read) by the gateway's token store next to the single-token files."""

from __future__ import annotations

import hashlib
import os
import stat
import time

import pytest

from rlserve.security.identity import TokenStore
from rlserve.security.principal import Principal, Role
from rlserve.security.tokens import new_token
from rlserve.security.users import add_user, read_users, revoke_user


def test_add_keeps_only_the_digest_and_revoke_removes_the_user(tmp_path):
    path = tmp_path / "state" / "users"
    alice = add_user(path, "alice", admin=False)
    root = add_user(path, "root", admin=True)
    text = path.read_text()
    assert alice not in text and root not in text
    assert f"alice sha256:{hashlib.sha256(alice.encode()).hexdigest()}\n" in text
    assert text.splitlines()[1].endswith(" admin")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [(u.principal, u.digest) for u in read_users(path)] == [
        (Principal("alice", Role.USER), hashlib.sha256(alice.encode()).digest()),
        (Principal("root", Role.ADMIN), hashlib.sha256(root.encode()).digest())]
    with pytest.raises(ValueError, match="exists already"):
        add_user(path, "alice", admin=False)
    revoke_user(path, "alice")
    assert [u.principal.name for u in read_users(path)] == ["root"]
    with pytest.raises(ValueError, match="no user 'alice'"):
        revoke_user(path, "alice")
    assert read_users(tmp_path / "missing") == []


@pytest.mark.parametrize("name", ["user", "admin", "system", "Alice", "a b", "-x", "x" * 33, "", "a.b"])
def test_names_are_short_folder_safe_words_and_not_the_reserved_ones(tmp_path, name):
    with pytest.raises(ValueError):
        add_user(tmp_path / "users", name, admin=False)
    assert not (tmp_path / "users").exists()


@pytest.mark.parametrize("text, problem", [
    ("alice\n", "a user line is"),
    ("alice sha256:abc\n", "64 hex digits"),
    (f"alice {'0' * 64}\n", "64 hex digits"),
    (f"alice sha256:{'g' * 64}\n", "64 hex digits"),
    (f"alice sha256:{'0' * 64} root\n", "a user line is"),
    (f"alice sha256:{'0' * 64}\nalice sha256:{'1' * 64}\n", "listed twice"),
    (f"alice sha256:{'0' * 64}\nbob sha256:{'0' * 64}\n", "another user"),
    (f"user sha256:{'0' * 64}\n", "reserved"),
])
def test_a_broken_users_file_is_refused_naming_the_line(tmp_path, text, problem):
    path = tmp_path / "users"
    path.write_text(f"# the team\n\n{text}")
    os.chmod(path, 0o600)
    with pytest.raises(ValueError, match=problem) as err:
        read_users(path)
    assert str(path) in str(err.value)
    with pytest.raises(ValueError):
        add_user(path, "carol", admin=False)  # nothing is written over a broken file


def test_a_users_file_others_may_read_is_refused_and_comments_survive_edits(tmp_path):
    path = tmp_path / "users"
    path.write_text("# operators: keep this file 0600\n")
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_users(path)
    os.chmod(path, 0o600)
    add_user(path, "alice", admin=False)
    revoke_user(path, "alice")
    assert path.read_text() == "# operators: keep this file 0600\n"


def test_the_token_store_names_every_token_and_re_reads_the_users_file(tmp_path):
    user_file, admin_file, users = tmp_path / "token", tmp_path / "admin_token", tmp_path / "users"
    plain, operator = new_token(), new_token()
    for path, token in ((user_file, plain), (admin_file, operator)):
        path.write_text(token + "\n")
        os.chmod(path, 0o600)
    store = TokenStore({Role.USER: user_file, Role.ADMIN: admin_file}, users)  # no users file yet: fine
    assert store.principal_of(plain) == Principal("user", Role.USER)
    assert store.principal_of(operator) == Principal("admin", Role.ADMIN)
    alice = add_user(users, "alice", admin=False)
    # A key issued a moment after the store's last look works at once (a client uses it right away).
    assert store.principal_of(alice) == Principal("alice", Role.USER)
    revoke_user(users, "alice")
    time.sleep(1.1)
    assert store.principal_of(alice) is None and store.principal_of(plain) == Principal("user", Role.USER)
