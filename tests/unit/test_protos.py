"""The contracts: every proto compiles, the committed stubs are current and import, and the
buf style rules hold (one request and one response message per RPC, enums start at _UNSPECIFIED)."""

from __future__ import annotations

import importlib
import re

from rlserve import protogen


def test_committed_stubs_are_current(tmp_path):
    generated = protogen.generate(tmp_path)
    committed = protogen.OUT_ROOT / "rlserve" / "v1"
    assert generated, "protoc produced nothing"
    for path in generated:
        mine = committed / path.name
        assert mine.is_file(), f"{path.name} is not committed: run `make protos`"
        assert mine.read_text() == path.read_text(), f"{path.name} is stale: run `make protos`"


def test_stubs_import():
    for proto in protogen.proto_files():
        importlib.import_module(f"rlserve.v1.{proto.stem}_pb2")
        importlib.import_module(f"rlserve.v1.{proto.stem}_pb2_grpc")


def test_buf_style():
    seen_requests = set()
    for proto in protogen.proto_files():
        text = proto.read_text()
        assert "package rlserve.v1;" in text
        for name, req, resp in re.findall(r"rpc (\w+)\((\w+)\) returns \((?:stream )?(\w+)\)", text):
            assert req == f"{name}Request" and resp == f"{name}Response", name
            assert req not in seen_requests
            seen_requests.add(req)
        for enum, body in re.findall(r"enum (\w+) \{(.*?)\}", text, re.S):
            prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum).upper()
            values = re.findall(r"(\w+) = (\d+);", body)
            assert values[0] == (f"{prefix}_UNSPECIFIED", "0"), enum
            assert all(v.startswith(prefix + "_") for v, _ in values), enum
    assert len(seen_requests) == 24
