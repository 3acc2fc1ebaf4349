"""Derive the Serve config (one entry per service application) from the cluster file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from rlserve.cluster.config import ClusterFile

# name -> builder import path; the gRPC proxy routes by the `application` metadata.
APPS = {
    "reward": "services.reward.app:build",
    "reference": "services.reference.app:build",
    "rollout": "services.rollout.app:build",
    "learner": "services.learner.app:build",
    "coordinator": "services.coordinator.app:build",
}
SERVICERS = [f"rlserve.v1.{m}_pb2_grpc.add_{s}Servicer_to_server" for m, s in (
    ("coordinator", "Coordinator"), ("rollout", "Rollout"), ("reward", "Reward"), ("reference", "Reference"),
    ("learner", "Learner"))]


def app_args(cfg: ClusterFile, name: str, runs_dir: Path) -> dict[str, Any]:
    svc = getattr(cfg.services, name)
    args = dict(svc.args)
    args["deployment"] = {"num_replicas": svc.replicas, "num_cpus": svc.num_cpus, "num_gpus": svc.num_gpus,
                          "env_vars": svc.env_vars, "resources": svc.resources}
    if name == "coordinator":
        args.setdefault("runs_dir", str(runs_dir))
    return args


def serve_config(cfg: ClusterFile, runs_dir: Path) -> dict[str, Any]:
    """A Serve config document (the `serve deploy` / KubeRay `serveConfigV2` shape)."""
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": cfg.host, "port": cfg.http_port},
        "grpc_options": {"port": cfg.grpc_port, "grpc_servicer_functions": SERVICERS},
        # Every app needs a route prefix: Serve's gRPC proxy only routes to apps that have one.
        "applications": [{"name": name, "import_path": path, "route_prefix": f"/{name}",
                          "args": app_args(cfg, name, runs_dir)} for name, path in APPS.items()],
    }


def args_version(args: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(args, sort_keys=True, default=str).encode()).hexdigest()[:10]
