"""A standalone reward and environment server: any gRPC server implementing `rlserve.v1.Reward` can
replace the reward service, and one implementing `rlserve.v1.Environment` the environments. Point a
run at it with `reward.endpoint: HOST:PORT` or `env.endpoint: HOST:PORT`.

    .venv/bin/python scripts/reward_server.py --port 50070 --function exact_match
    .venv/bin/python scripts/reward_server.py --port 50070 --function path/to/my_reward.py:reward

It runs outside Ray and Serve (only grpcio and the rlserve library), with health checking and
reflection, and binds to 127.0.0.1 unless --host says otherwise. A Score request may name the
built-ins, the server's own --function plug-ins and those given with --allow-plugin; any other
import path is refused with PERMISSION_DENIED (a request must never choose code to run). Reset and
Step requests may name the built-in environments and --allow-plugin ones (`single_turn` without
functions scores with the --function ones).
"""

from __future__ import annotations

import argparse
import logging
import signal
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rlserve.environments import serving as environments
from rlserve.environments.loader import Environments
from rlserve.logs import event, setup_logging
from rlserve.rewards.config import RewardFunctionCfg
from rlserve.rewards.loader import CombinedReward
from rlserve.rewards.scoring import functions_from_proto, score_batch
from rlserve.rpc import RpcError
from rlserve.security.plugins import PluginPolicy
from rlserve.v1 import environment_pb2, environment_pb2_grpc, reward_pb2, reward_pb2_grpc

log = logging.getLogger("rlserve.reward_server")


class RewardServicer(reward_pb2_grpc.RewardServicer):
    def __init__(self, default: CombinedReward, plugins: PluginPolicy):
        self.default = default
        self.plugins = plugins

    def Score(self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext) -> reward_pb2.ScoreResponse:
        try:
            reward = (CombinedReward(functions_from_proto(list(request.functions), self.plugins)) if request.functions
                      else self.default)
            response = score_batch(reward, request)
        except RpcError as err:
            context.abort(err.code, err.message)
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"functions: {err}")
        event(log, "reward_server.scored", run=request.run_id or None, items=len(request.items),
              errors=response.num_errors)
        return response


class EnvironmentServicer(environment_pb2_grpc.EnvironmentServicer):
    def __init__(self, environments: Environments):
        self.environments = environments

    def Reset(self, request: environment_pb2.ResetRequest, context: grpc.ServicerContext
              ) -> environment_pb2.ResetResponse:
        try:
            env, version = self.environments.get(request.environment)
            return environments.reset(env, version, request)
        except RpcError as err:
            context.abort(err.code, err.message)

    def Step(self, request: environment_pb2.StepRequest, context: grpc.ServicerContext
             ) -> environment_pb2.StepResponse:
        try:
            env, version = self.environments.get(request.environment)
            return environments.step(env, version, request)
        except RpcError as err:
            context.abort(err.code, err.message)


def serve(host: str, port: int, functions: list[str], allowed_plugins: list[str]) -> grpc.Server:
    specs = []
    for f in functions:
        name = f.rsplit("/", 1)[-1].split(":")[0].removesuffix(".py")
        specs.append(RewardFunctionCfg(name=name, import_path=None if ":" not in f and not f.endswith(".py") else f))
    # Threads: an environment that hangs holds one until it returns (the caller's env.timeout_s ends the episode).
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    plugins = PluginPolicy([*allowed_plugins, *(s.import_path for s in specs if s.import_path)])
    default = CombinedReward(specs)
    reward_pb2_grpc.add_RewardServicer_to_server(RewardServicer(default, plugins), server)
    environment_pb2_grpc.add_EnvironmentServicer_to_server(
        EnvironmentServicer(Environments(PluginPolicy(allowed_plugins), default)), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("rlserve.v1.Reward", "rlserve.v1.Environment"):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name,
                                         environment_pb2.DESCRIPTOR.services_by_name["Environment"].full_name,
                                         reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    event(log, "reward_server.ready", address=f"{host}:{bound}", functions=",".join(functions))
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50070)
    parser.add_argument("--function", action="append", default=None,
                        help="built-in name, module:attr or file.py[:attr]; repeatable (default exact_match)")
    parser.add_argument("--allow-plugin", action="append", default=[], metavar="IMPORT_PATH",
                        help="a plug-in Score requests may name (module:attr or file.py[:attr]); repeatable")
    args = parser.parse_args()
    setup_logging()
    server = serve(args.host, args.port, args.function or ["exact_match"], args.allow_plugin)
    signal.signal(signal.SIGTERM, lambda *_: server.stop(grace=2))
    server.wait_for_termination()


if __name__ == "__main__":
    main()
