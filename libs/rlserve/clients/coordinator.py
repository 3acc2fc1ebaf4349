"""A typed gRPC client of the coordinator (through the cluster's gateway)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

from rlserve.clients.credentials import Credentials, find_credentials
from rlserve.v1 import coordinator_pb2 as pb
from rlserve.v1 import coordinator_pb2_grpc

DEFAULT_ENDPOINT = "127.0.0.1:9000"
_TERMINAL = {pb.RUN_STATE_SUCCEEDED, pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED, pb.RUN_STATE_PAUSED}
ENDPOINT_ENV = "RLSERVE_ENDPOINT"


def default_endpoint() -> str:
    return os.environ.get(ENDPOINT_ENV, DEFAULT_ENDPOINT)


class CoordinatorClient:
    def __init__(self, endpoint: str | None = None, token_file: Path | None = None, ca_file: Path | None = None,
                 credentials: Credentials | None = None):
        """Credentials default to what `find_credentials` finds for the endpoint."""
        self.endpoint = endpoint or default_endpoint()
        creds = credentials or find_credentials(self.endpoint, token_file, ca_file)
        self.channel = creds.channel(self.endpoint)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.metadata = creds.metadata()

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, spec_yaml: str, run_id: str = "", resume: bool = False) -> pb.Run:
        req = pb.SubmitRunRequest(spec_yaml=spec_yaml, run_id=run_id, resume=resume)
        return self.stub.SubmitRun(req, metadata=self.metadata, timeout=300).run

    def get(self, run_id: str) -> pb.Run:
        return self.stub.GetRun(pb.GetRunRequest(run_id=run_id), metadata=self.metadata, timeout=30).run

    def list(self) -> list[pb.Run]:
        return list(self.stub.ListRuns(pb.ListRunsRequest(), metadata=self.metadata, timeout=30).runs)

    def cancel(self, run_id: str) -> pb.Run:
        return self.stub.CancelRun(pb.CancelRunRequest(run_id=run_id), metadata=self.metadata, timeout=60).run

    def watch(self, run_id: str, from_sequence: int = 0, timeout_s: float | None = None) -> Iterator[pb.RunEvent]:
        """The run's events until it ends; with `timeout_s`, the stream fails with DEADLINE_EXCEEDED after that
        long, however the run is doing (a client that must not hang sets it). The coordinator ends a
        stream after a while (`watch_max_s`); this continues from the next event until the run ends."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(0.001, deadline - time.monotonic())
            stream = self.stub.WatchRun(pb.WatchRunRequest(run_id=run_id, from_sequence=from_sequence),
                                        metadata=self.metadata, timeout=left)
            for resp in stream:
                from_sequence = resp.event.sequence + 1
                yield resp.event
            if self.get(run_id).state in _TERMINAL:
                return
