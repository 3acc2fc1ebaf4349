"""Every RPC of the rlserve.v1 services, which application serves it, and who may call it.

Run-facing RPCs (the Coordinator and Agents services) are public: a user token reaches
them, and they act for the caller (the gateway passes its principal). The services the coordinator
calls by handle (Rollout, Reward, Environment, Reference, Learner) are internal: the gateway serves
them only when the
cluster file sets `expose_internal`, and then to admin tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf import message_factory
from google.protobuf.message import Message

from rlserve.v1 import agents_pb2, coordinator_pb2, environment_pb2, learner_pb2, reference_pb2, reward_pb2, rollout_pb2

# proto service -> (module, application, public)
_SERVICES = {
    "Coordinator": (coordinator_pb2, "coordinator", True),
    # External agents' episodes and calls (rlserve.agents), served by the coordinator for its runs.
    "Agents": (agents_pb2, "coordinator", True),
    "Rollout": (rollout_pb2, "rollout", False),
    "Reward": (reward_pb2, "reward", False),
    # The reward application also serves the environments.
    "Environment": (environment_pb2, "reward", False),
    "Reference": (reference_pb2, "reference", False),
    "Learner": (learner_pb2, "learner", False),
}


@dataclass(frozen=True)
class RpcMethod:
    service: str  # full name, e.g. "rlserve.v1.Coordinator"
    name: str  # e.g. "GetRun"
    app: str  # the Serve application (and deployment method name is `name`)
    request: type[Message]
    response: type[Message]
    server_streaming: bool
    public: bool

    @property
    def takes_caller(self) -> bool:
        """The run-facing RPCs act for the caller: the gateway passes its principal after the request."""
        return self.public

    @property
    def path(self) -> str:
        """The gRPC method path, `/rlserve.v1.Coordinator/GetRun`."""
        return f"/{self.service}/{self.name}"


def all_methods(apps: dict[str, str] | None = None) -> list[RpcMethod]:
    """Every RPC; `apps` renames applications (default: the lower-case service name)."""
    out = []
    for service_name, (module, app, public) in _SERVICES.items():
        service = module.DESCRIPTOR.services_by_name[service_name]
        for m in service.methods:
            if m.client_streaming:
                raise AssertionError(f"{m.full_name}: client streaming is not forwarded")
            out.append(RpcMethod(service.full_name, m.name, (apps or {}).get(app, app),
                                 message_factory.GetMessageClass(m.input_type),
                                 message_factory.GetMessageClass(m.output_type), m.server_streaming, public))
    return out

