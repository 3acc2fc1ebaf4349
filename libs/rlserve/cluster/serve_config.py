"""Derive the Serve config (one entry per application) from the cluster file.

The public endpoint is the `gateway` application (services/gateway): it
authenticates every call and forwards it to the services through Serve
handles. Serve's own HTTP and gRPC proxies are turned off
(`proxy_location: Disabled`), so nothing reaches a service without passing
the gateway; inside the cluster the services call each other by handle.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from rlserve.cluster.config import ClusterFile

# name -> builder import path.
APPS = {
    "reward": "services.reward.app:build",
    "reference": "services.reference.app:build",
    "rollout": "services.rollout.app:build",
    "learner": "services.learner.app:build",
    "coordinator": "services.coordinator.app:build",
    "gateway": "services.gateway.app:build",
}
# Services whose requests name files: they get the cluster's directories.
_WITH_PATHS = ("reference", "rollout", "learner", "coordinator")
# PyTorch's CUDA caching allocator reads its settings from here when a process first allocates on a GPU.
CUDA_ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
# The gateway forwards calls; it needs little CPU.
GATEWAY_NUM_CPUS = 0.05


def state_dir(runs_dir: Path) -> Path:
    """Cluster state (head pid, logs, deployed config, default token and users files)."""
    return runs_dir / ".cluster"


def token_files(cfg: ClusterFile, runs_dir: Path) -> tuple[Path, Path] | None:
    """(user token file, admin token file), or None when the cluster file says `auth: none`."""
    if cfg.auth == "none":
        return None
    return (Path(cfg.auth.token_file or state_dir(runs_dir) / "token"),
            Path(cfg.auth.admin_token_file or state_dir(runs_dir) / "admin_token"))


def users_file(cfg: ClusterFile, runs_dir: Path) -> Path | None:
    """The users file (`deploy/serve users`), or None when the cluster file says `auth: none`."""
    if cfg.auth == "none":
        return None
    return Path(cfg.auth.users_file or state_dir(runs_dir) / "users")


def _paths(cfg: ClusterFile, runs_dir: Path) -> dict[str, Any]:
    return {"runs_dir": str(runs_dir), "model_dirs": list(cfg.model_dirs), "data_dirs": list(cfg.data_dirs)}


def _gateway(cfg: ClusterFile, runs_dir: Path) -> dict[str, Any]:
    tokens = token_files(cfg, runs_dir)
    return {"host": cfg.host, "port": cfg.grpc_port, "http_port": cfg.http_port, "expose_internal": cfg.expose_internal,
            "tenancy": cfg.tenancy.model_dump(exclude_none=True), "read_cache_ms": cfg.read_cache_ms,
            "auth": None if tokens is None else {"token_file": str(tokens[0]), "admin_token_file": str(tokens[1]),
                                                 "users_file": str(users_file(cfg, runs_dir))},
            "tls": None if cfg.tls is None else {"cert_file": cfg.tls.cert_file, "key_file": cfg.tls.key_file}}


def _allocator_env(cfg: ClusterFile, name: str) -> dict[str, str]:
    """The cluster's CUDA allocator settings for a service that uses a GPU (`ClusterFile.cuda_alloc_conf`)."""
    if not cfg.cuda_alloc_conf or not cfg.uses_gpu(name):
        return {}
    return {CUDA_ALLOC_CONF_ENV: cfg.cuda_alloc_conf}


def app_args(cfg: ClusterFile, name: str, runs_dir: Path) -> dict[str, Any]:
    svc = getattr(cfg.services, name, None)
    args = dict(svc.args) if svc else {}
    if name in _WITH_PATHS:
        args["paths"] = _paths(cfg, runs_dir)
    if name in ("reward", "coordinator"):
        args["allowed_plugins"] = list(cfg.reward.allowed_plugins)
        args["allowed_models"] = list(cfg.reward.allowed_models)
    if name == "coordinator":
        args["allowed_endpoints"] = list(cfg.reward.allowed_endpoints)
        args["tenancy"] = cfg.tenancy.model_dump(exclude_none=True)
        args["generation_shares_cpu_cores"] = cfg.generation_shares_cpu_cores
        # Re-read by the coordinator when it changes (its `tenancy`); None for a config built in code.
        args["cluster_file"] = str(cfg.source) if cfg.source else None
    if name == "gateway":
        args.update(_gateway(cfg, runs_dir))
        if "watch_max_s" in cfg.services.coordinator.args:  # its streams end as the coordinator's do
            args["watch_max_s"] = cfg.services.coordinator.args["watch_max_s"]
        # One replica on the head node: it binds the endpoint's port, and stops before a new one starts.
        args["deployment"] = {"num_replicas": 1, "num_cpus": GATEWAY_NUM_CPUS, "num_gpus": 0.0,
                              "max_surge_percent": 0, "resources": {"node:__internal_head__": 0.001},
                              "cpu_cores": list(cfg.gateway_cpu_cores)}
    else:
        # The cluster's plug-ins reach the replicas and what they start (learner workers inherit the
        # replica's runtime environment, the coordinator's spec reader its process environment).
        args["deployment"] = {"num_replicas": svc.replicas, "num_cpus": svc.num_cpus, "num_gpus": svc.num_gpus,
                              "env_vars": {**_allocator_env(cfg, name), **svc.env_vars, **cfg.plugins.env()},
                              "resources": svc.resources, "cpu_cores": svc.cpu_cores, "nice": svc.nice}
    return args


def serve_config(cfg: ClusterFile, runs_dir: Path) -> dict[str, Any]:
    """A Serve config document (the `serve deploy` / KubeRay `serveConfigV2` shape)."""
    return {
        "proxy_location": "Disabled",
        "applications": [{"name": name, "import_path": path, "route_prefix": None,
                          "args": app_args(cfg, name, runs_dir)} for name, path in APPS.items()],
    }


def args_version(args: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(args, sort_keys=True, default=str).encode()).hexdigest()[:10]
