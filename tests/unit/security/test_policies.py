"""Token files, path confinement, the plug-in allow-list and client credential discovery."""

from __future__ import annotations

import os
import stat

import grpc
import pytest

from rlserve.clients.credentials import TOKEN_ENV, TOKEN_FILE_ENV, find_credentials, write_record
from rlserve.rpc import RpcError
from rlserve.security.identity import TokenStore
from rlserve.security.paths import PathPolicy
from rlserve.security.plugins import PluginPolicy
from rlserve.security.principal import Principal, Role
from rlserve.security.tokens import MIN_TOKEN_CHARS, bearer_token, ensure_token_file, read_tokens


def test_token_files_are_private_and_checked(tmp_path):
    path = tmp_path / "state" / "token"
    assert ensure_token_file(path) and not ensure_token_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    (token,) = read_tokens(path)
    assert len(token) >= MIN_TOKEN_CHARS
    os.chmod(path, 0o640)
    with pytest.raises(ValueError, match="chmod 600"):
        read_tokens(path)
    weak = tmp_path / "weak"
    weak.write_text("# operators\nshort\n")
    os.chmod(weak, 0o600)
    with pytest.raises(ValueError, match="weak:2"):
        read_tokens(weak)


def test_roles_and_bearer_parsing(tmp_path):
    user, admin = tmp_path / "u", tmp_path / "a"
    for path, tokens in ((user, ["u" * 40, "v" * 40]), (admin, ["a" * 40])):
        path.write_text("\n".join(tokens) + "\n")
        os.chmod(path, 0o600)
    store = TokenStore({Role.USER: user, Role.ADMIN: admin})
    assert store.principal_of("u" * 40) == store.principal_of("v" * 40) == Principal("user", Role.USER)
    assert store.principal_of("a" * 40) == Principal("admin", Role.ADMIN)
    assert store.principal_of("a" * 39) is None and store.principal_of(None) is None
    assert bearer_token((("authorization", "Bearer  abc "),)) == "abc"
    assert bearer_token((("Authorization", "bearer abc"),)) == "abc"
    assert bearer_token((("authorization", "Basic abc"),)) is None and bearer_token(()) is None
    with pytest.raises(ValueError, match="no such token file"):
        TokenStore({Role.USER: tmp_path / "missing"})


@pytest.fixture
def policy(tmp_path):
    for d in ("runs/r1", "models/m", "data", "elsewhere/m"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "models" / "m" / "config.json").write_text("{}")
    (tmp_path / "models" / "escape").symlink_to(tmp_path / "elsewhere")
    return PathPolicy(tmp_path / "runs", (tmp_path / "models",), (tmp_path / "data",))


def _refused(fn, *args) -> RpcError:
    with pytest.raises(RpcError) as err:
        fn(*args)
    return err.value


def test_paths_stay_inside_the_cluster_directories(policy, tmp_path):
    assert policy.model("f", "m") == tmp_path / "models" / "m"
    assert policy.model("f", str(tmp_path / "models" / "m")) == tmp_path / "models" / "m"
    assert policy.model("f", "r1") == tmp_path / "runs" / "r1", "a run's output is a valid model source"
    assert policy.run_path("f", "r1/ckpt") == tmp_path / "runs" / "r1" / "ckpt"
    assert policy.model_name("f", "preset:tiny") == "preset:tiny"
    for value in ("../elsewhere/m", "m/../../elsewhere", "/etc", str(tmp_path / "elsewhere" / "m"),
                  str(tmp_path / "models" / "escape" / "m"),
                  "", "a\x00b", "x" * 5000):
        err = _refused(policy.model, "policy.model_name", value)
        assert err.code == grpc.StatusCode.PERMISSION_DENIED and err.message.startswith("policy.model_name:")
    assert "`model_dirs`" in _refused(policy.model, "f", "/etc").message
    assert "`runs_dir`" in _refused(policy.run_path, "path", str(tmp_path / "models" / "m")).message
    assert "`data_dirs`" in _refused(policy.data, "data.train_path", "/etc/passwd").message
    err = _refused(policy.model_name, "f", "nothing-here")
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "config.json" in err.message


def test_plugins_only_from_the_allow_list(tmp_path):
    plugin = tmp_path / "plug.py"
    policy = PluginPolicy(["pkg.mod:fn", f"{plugin}:reward"])
    policy.check("f", "pkg.mod:fn")
    policy.check("f", f"{plugin}")  # attr defaults to `reward`
    policy.check("f", f"{tmp_path}/./plug.py:reward")
    for refused in ("subprocess:Popen", "pkg.mod:other", "pkg.mod", f"{plugin}:other", "os:system"):
        err = _refused(policy.check, "reward.functions.0.import_path", refused)
        assert err.code == grpc.StatusCode.PERMISSION_DENIED
        assert refused in err.message and "reward.allowed_plugins" in err.message


def test_clients_find_the_token_in_order(tmp_path, monkeypatch):
    monkeypatch.setenv("RLSERVE_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    recorded, given = tmp_path / "recorded", tmp_path / "given"
    for path, token in ((recorded, "r" * 40), (given, "g" * 40)):
        path.write_text(token + "\n")
        os.chmod(path, 0o600)
    assert find_credentials("127.0.0.1:1").token is None
    record = write_record("127.0.0.1:1", recorded, None)
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert find_credentials("127.0.0.1:1").token == "r" * 40
    assert find_credentials("127.0.0.1:2").token is None, "records are per endpoint"
    assert find_credentials("127.0.0.1:1", token_file=given).token == "g" * 40
    monkeypatch.setenv(TOKEN_ENV, "e" * 40)
    assert find_credentials("127.0.0.1:1", token_file=given).token == "e" * 40
    creds = find_credentials("127.0.0.1:1", ca_file=tmp_path / "ca.pem")
    assert creds.metadata() == (("authorization", "Bearer " + "e" * 40),) and creds.ca_file == tmp_path / "ca.pem"
