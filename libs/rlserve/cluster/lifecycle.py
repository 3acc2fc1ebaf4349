"""Bring a cluster up and down, show it, and swap the reward service.

Ray is imported only after the loopback switch is in the environment
(`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` makes Ray keep a 127.0.0.1 node
address instead of rewriting it to the machine's external one, which is
what makes its listeners bind loopback).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlserve.cluster import gpu_memory
from rlserve.cluster.config import ClusterFile
from rlserve.cluster.loopback import BIND_HOST_ENV
from rlserve.cluster.serve_config import (
    APPS,
    app_args,
    args_version,
    serve_config,
    state_dir,
    token_files,
    users_file,
)

SETUP_HOOK = "rlserve.cluster.loopback.bind_loopback"


@dataclass(frozen=True)
class Cluster:
    cfg: ClusterFile
    runs_dir: Path

    @property
    def state_dir(self) -> Path:
        return state_dir(self.runs_dir)

    @property
    def token_files(self) -> tuple[Path, Path] | None:
        """(user, admin) token files; None with `auth: none`."""
        return token_files(self.cfg, self.runs_dir)

    @property
    def users_file(self) -> Path | None:
        """Named users and their token digests (`deploy/serve users`); None with `auth: none`."""
        return users_file(self.cfg, self.runs_dir)

    @property
    def ca_file(self) -> Path | None:
        """What a client trusts for this endpoint (TLS only)."""
        tls = self.cfg.tls
        return None if tls is None else Path(tls.ca_file or tls.cert_file)

    @property
    def ray_token_file(self) -> Path:
        """The local head's Ray token (RAY_AUTH_TOKEN_PATH); `up` creates it, mode 0600."""
        return self.state_dir / "ray_token"

    @property
    def address(self) -> str:
        return self.cfg.address or f"{self.cfg.host}:{self.cfg.ray_port}"

    @property
    def grpc_endpoint(self) -> str:
        return f"{self.cfg.host}:{self.cfg.grpc_port}"

    @property
    def http_url(self) -> str | None:
        """The HTTP listener's base URL (the OpenAI-compatible endpoint is under /v1); None: no listener."""
        if self.cfg.http_port is None:
            return None
        return f"{'https' if self.cfg.tls else 'http'}://{self.cfg.host}:{self.cfg.http_port}"

    def env(self) -> dict[str, str]:
        """Environment for Ray processes and drivers of this cluster."""
        env = {BIND_HOST_ENV: self.cfg.host, "RAY_USAGE_STATS_ENABLED": "0",
               # Fixed default ports of Ray's helpers, moved next to ray_port so that two
               # clusters (say, the demo and the tests) can run on one machine.
               "AUTOSCALER_METRIC_PORT": str(self.cfg.ray_port + 3),
               "DASHBOARD_METRIC_PORT": str(self.cfg.ray_port + 4),
               # Ray starts every worker at niceness 15, under its raylet and GCS; rlserve ranks its own:
               # the control plane's replicas at 0 beside Ray's daemons, the compute services' below
               # them (`services.<name>.nice`, rlserve.cpu_affinity).
               "RAY_worker_niceness": "0",
               # Ray's and Serve's own intervals for a small cluster (the cluster file's `ray`).
               **self.cfg.ray.env_vars()}
        if self.cfg.loopback and not self.cfg.address:
            env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        if not self.cfg.address:
            # Ray 2.60 decides token auth per process: `ray start --head` turns it on only if
            # ~/.ray/auth_token exists (a local `ray.init()` once wrote it), and `ray.init(address=...)`
            # never does, so a head started after any local ray.init() refused this driver
            # ("could not connect to 127.0.0.1:6380"). Head, nodes, workers and drivers all get the
            # same explicit mode and this cluster's own token file instead.
            env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.ray_token_file)})
        return env


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.5)


def _pid_file(cluster: Cluster, node: str | None) -> Path:
    return cluster.state_dir / ("head.pid" if node is None else f"node-{node}.pid")


def _running_pid(pid_file: Path) -> int | None:
    """The pid in `pid_file`, if that process still runs."""
    if not pid_file.is_file():
        return None
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    return pid


def _head_pid(cluster: Cluster) -> int | None:
    """The pid of the head this cluster file started, if it still runs."""
    return _running_pid(_pid_file(cluster, None))


def node_marker(name: str) -> str:
    """A resource every extra node offers once (`rlserve_node_<name>: 1`), to find it among Ray's nodes."""
    return f"rlserve_node_{name}"


# Every process of the cluster writes its files for this user only: run folders 0700, files 0600
# (specs, events, checkpoints, models: a run's data is its owner's).
PRIVATE_UMASK = 0o077


def ensure_ray_token(cluster: Cluster) -> None:
    """This cluster's Ray token file (mode 0600, 64 hex digits, no newline), created if missing."""
    path = cluster.ray_token_file
    if path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def start_head(cluster: Cluster) -> None:
    """Start `ray start --head --block` in its own session; its pid file lets `down` stop exactly it."""
    cfg = cluster.cfg
    if _head_pid(cluster) is not None and _port_open(cfg.host, cfg.ray_port):
        return  # already up (a re-run of `up` redeploys onto it)
    if _port_open(cfg.host, cfg.ray_port):
        raise RuntimeError(f"something already listens on {cfg.host}:{cfg.ray_port} (ray_port); "
                           f"run `deploy/serve down` for that cluster or pick another ray_port")
    cluster.state_dir.mkdir(parents=True, exist_ok=True)
    ensure_ray_token(cluster)
    # Ray's CLI through this interpreter, not `<interpreter dir>/ray`: an install by PYTHONPATH (an
    # unpacked offline bundle, `pip install --target`) has no such script.
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={cfg.ray_port}",
           f"--ray-client-server-port={cfg.ray_port + 1}", f"--dashboard-agent-listen-port={cfg.ray_port + 2}",
           f"--object-store-memory={cfg.object_store_memory_mb * 2**20}", "--disable-usage-stats",
           f"--include-log-monitor={str(cfg.ray.log_monitor).lower()}"]
    if cfg.num_cpus:
        cmd.append(f"--num-cpus={cfg.num_cpus}")
    if cfg.num_gpus is not None:
        cmd.append(f"--num-gpus={cfg.num_gpus}")
    if cfg.dashboard_port:
        cmd += ["--include-dashboard=true", f"--dashboard-host={cfg.host}", f"--dashboard-port={cfg.dashboard_port}"]
    else:
        cmd.append("--include-dashboard=false")
    log = open(cluster.state_dir / "ray-head.log", "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, umask=PRIVATE_UMASK,
                            env={**os.environ, **cluster.env()})
    (cluster.state_dir / "head.pid").write_text(f"{proc.pid}\n")
    try:
        _wait(lambda: _port_open(cfg.host, cfg.ray_port) or proc.poll() is not None, 120, "the Ray head")
    finally:
        log.close()
    if proc.poll() is not None:
        raise RuntimeError(f"ray start failed (exit {proc.returncode}); see {cluster.state_dir / 'ray-head.log'}")


def start_node(cluster: Cluster, index: int) -> None:
    """Join extra node `index` of the cluster file to the head: `ray start --address` on `host` in its own
    session (its pid file lets `down` and `kill_node` stop exactly it); returns once Ray lists it."""
    cfg, node = cluster.cfg, cluster.cfg.nodes[index]
    pid_file = _pid_file(cluster, node.name)
    if _running_pid(pid_file) is not None:
        return
    resources = {**node.resources, node_marker(node.name): 1}
    cmd = [sys.executable, "-m", "rlserve.cluster.join", f"--address={cluster.address}", "--block",
           f"--node-ip-address={cfg.host}",
           f"--num-cpus={node.num_cpus}", f"--resources={json.dumps(resources)}",
           f"--object-store-memory={node.object_store_memory_mb * 2**20}", "--disable-usage-stats",
           f"--include-log-monitor={str(cfg.ray.log_monitor).lower()}",
           # Ray's fixed default would collide with the head's (and other nodes') agent on one machine.
           f"--dashboard-agent-listen-port={cfg.ray_port + 10 + index}"]
    log = open(cluster.state_dir / f"ray-node-{node.name}.log", "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, umask=PRIVATE_UMASK,
                            env={**os.environ, **cluster.env()})
    log.close()
    pid_file.write_text(f"{proc.pid}\n")
    connect(cluster)
    import ray

    def joined() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start for node {node.name} failed (exit {proc.returncode}); see "
                               f"{cluster.state_dir / f'ray-node-{node.name}.log'}")
        return any(n["Alive"] and node_marker(node.name) in n["Resources"] for n in ray.nodes())

    _wait(joined, 120, f"node {node.name} to join")


def kill_node(cluster: Cluster, name: str) -> None:
    """SIGKILL an extra node's processes at once, as a machine that dies would (fault injection)."""
    pid = _running_pid(_pid_file(cluster, name))
    if pid is None:
        raise RuntimeError(f"node {name} is not running")
    os.killpg(pid, signal.SIGKILL)
    _pid_file(cluster, name).unlink(missing_ok=True)


_CONNECT_ATTEMPTS = 6


def connect(cluster: Cluster) -> None:
    """Attach this process to the cluster as a driver whose workers keep listeners on `host` (a process
    attached to another cluster is detached first)."""
    os.environ.update(cluster.env())
    import ray

    if ray.is_initialized():
        if ray.get_runtime_context().gcs_address == cluster.address:
            return
        _detach()
    if "RAY_AUTH_TOKEN_PATH" in cluster.env():
        # Ray caches the token it read first: another cluster's, when this process was attached to one.
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    for attempt in range(_CONNECT_ATTEMPTS):  # a head just started may not have registered its node yet
        try:
            ray.init(address=cluster.address, namespace="rlserve", log_to_driver=False, logging_level="WARNING",
                     runtime_env={"worker_process_setup_hook": SETUP_HOOK, "env_vars": cluster.env()})
            return
        except ConnectionError:
            if attempt == _CONNECT_ATTEMPTS - 1:
                raise
            ray.shutdown()
            time.sleep(5)


def _serve_start(cluster: Cluster, config: dict[str, Any]) -> None:
    from ray import serve

    serve.start(proxy_location=config["proxy_location"])


def prepare_auth(cluster: Cluster) -> list[str]:
    """Create missing token files (mode 0600) and record the endpoint's credentials for clients.

    Returns lines for the operator: which files were created, or the warning that auth is off.
    """
    from rlserve.clients.credentials import write_record
    from rlserve.security.tokens import ensure_token_file

    files = cluster.token_files
    notes = []
    if files is None:
        notes.append("WARNING: `auth: none` in the cluster file: anyone who can reach "
                     f"{cluster.grpc_endpoint} can submit runs" + (" and call the internal services"
                                                                  if cluster.cfg.expose_internal else ""))
    else:
        for path in files:
            if ensure_token_file(path):
                notes.append(f"created token file {path} (mode 0600)")
    write_record(cluster.grpc_endpoint, files[0] if files else None, cluster.ca_file)
    return notes


def deploy(cluster: Cluster, config: dict[str, Any], only: list[str] | None = None, timeout_s: float = 600) -> None:
    """Deploy (or update) the named applications and wait until they run."""
    from ray import serve
    from ray._common.utils import import_attr
    from ray.serve import RunTarget

    apps = [a for a in config["applications"] if only is None or a["name"] in only]
    targets = [RunTarget(target=import_attr(a["import_path"])(a["args"]), name=a["name"],
                         route_prefix=a["route_prefix"]) for a in apps]
    serve.run_many(targets, wait_for_applications_running=False)
    names = [a["name"] for a in apps]

    def running() -> bool:
        status = serve.status().applications
        failed = {n: status[n].message for n in names if n in status and status[n].status == "DEPLOY_FAILED"}
        if failed:
            raise RuntimeError("deploy failed: " + "; ".join(f"{n}: {m}" for n, m in failed.items()))
        return all(n in status and status[n].status == "RUNNING" for n in names)

    _wait(running, timeout_s, f"applications {', '.join(names)} to run")
    (cluster.state_dir / "serve_config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def up(cluster: Cluster) -> dict[str, Any]:
    """Start what is not running (the head, extra nodes) and deploy every application; safe to repeat."""
    for line in gpu_memory.check(cluster.cfg):  # a layout that cannot fit is refused before anything starts
        print(f"serve: {line}", file=sys.stderr, flush=True)
    config = serve_config(cluster.cfg, cluster.runs_dir)
    cluster.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    for note in prepare_auth(cluster):
        print(f"serve: {note}", file=sys.stderr, flush=True)
    if not cluster.cfg.address:
        start_head(cluster)
    for index in range(len(cluster.cfg.nodes)):
        start_node(cluster, index)
    connect(cluster)
    _serve_start(cluster, config)
    deploy(cluster, config)
    return config


def served_engine(cluster: Cluster, timeout_s: float = 120) -> str:
    """The engine the rollout service generates with (its GetInfo), e.g. "transformers" where `engine: auto`
    found no vLLM for its device."""
    connect(cluster)
    from ray import serve

    from rlserve.v1 import rollout_pb2

    handle = serve.get_app_handle("rollout")
    return handle.GetInfo.remote(rollout_pb2.GetInfoRequest()).result(timeout_s=timeout_s).engine


def down(cluster: Cluster) -> None:
    """Stop the applications (the coordinator first, while the services its runs call are still up, so
    a run is interrupted, not failed, and resumes after `up`), then the extra nodes and the head."""
    # A local head without this cluster's token file was never started from this cluster file (another
    # cluster on the same port, say): there is nothing of ours to stop there, and no token to attach with.
    ours = cluster.cfg.address or (cluster.ray_token_file.is_file() and _port_open(cluster.cfg.host,
                                                                                    cluster.cfg.ray_port))
    if ours:
        connect(cluster)
        from ray import serve

        if "coordinator" in serve.status().applications:
            serve.delete("coordinator")
        serve.shutdown()
        _kill_named_actors()
    # With the applications stopped through Serve, what is left (Ray's own processes) holds nothing to save:
    # a short grace, not the 10-20 s that the head's raylet and GCS take over a SIGTERM.
    grace_s = 5.0 if ours else 20.0
    for name in [n.name for n in cluster.cfg.nodes] + [None]:  # extra nodes first, the head last
        pid = _running_pid(_pid_file(cluster, name))
        if pid is not None:
            _stop_group(pid, grace_s)
        _pid_file(cluster, name).unlink(missing_ok=True)
    if "ray" in sys.modules:  # this process was a driver of the stopped cluster: detach it
        _detach()


def _detach() -> None:
    import ray
    from ray.serve import context as serve_context

    ray.shutdown()
    serve_context._set_global_client(None)


def _kill_named_actors() -> None:
    """The actors that outlive their creators (the weight store, the fleet) end now: at SIGTERM a Ray
    worker waits for the call it runs, and theirs are long polls, so each would hold `down` for its
    whole grace period. Nothing of theirs outlives the cluster anyway. Only rlserve's namespace: a cluster
    file's `address` may name a Ray cluster that runs others' actors too."""
    import ray

    from rlserve.weights.store import STORE_NAMESPACE

    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] != STORE_NAMESPACE:
            continue
        try:
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
        except ValueError:  # ended meanwhile
            continue


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs. Its members that ended as this process's children
    (`ray start` of a node this process started) are reaped here; ended ones that wait for another parent
    (zombies) do not count: `killpg(pgid, 0)` would count them, and wait the whole grace period."""
    try:
        while os.waitpid(-pgid, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command, which may hold spaces
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _stop_group(pgid: int, grace_s: float = 20.0) -> None:
    """SIGTERM the head's process group (ray start and every process it spawned), SIGKILL stragglers."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)


def current_config(cluster: Cluster) -> dict[str, Any]:
    path = cluster.state_dir / "serve_config.yaml"
    if not path.is_file():
        raise RuntimeError(f"{path}: no deployed config; run `deploy/serve up` first")
    return yaml.safe_load(path.read_text())


def status(cluster: Cluster) -> list[dict[str, Any]]:
    """Per application: state, replicas per deployment and a version (hash of its args)."""
    connect(cluster)
    from ray import serve

    config = current_config(cluster)
    versions = {a["name"]: args_version(a["args"]) for a in config["applications"]}
    rows = []
    for name, app in serve.status().applications.items():
        replicas = {d: sum(s.replica_states.values()) if s.replica_states else 0
                    for d, s in app.deployments.items()}
        rows.append({"app": name, "state": getattr(app.status, "value", str(app.status)), "replicas": replicas,
                     "version": versions.get(name, "-"), "message": app.message})
    return rows


def node_status(cluster: Cluster) -> dict[str, bool]:
    """Whether each extra node of the cluster file is part of the cluster now."""
    connect(cluster)
    import ray

    alive = {r for n in ray.nodes() if n["Alive"] for r in n["Resources"]}
    return {node.name: node_marker(node.name) in alive for node in cluster.cfg.nodes}


def swap_reward(cluster: Cluster, target: str) -> dict[str, Any]:
    """Redeploy the reward app alone with a new function (`module:attr` or `file.py[:attr]`), or with the
    functions of the cluster file, arguments and weights included (`default`)."""
    from rlserve.rewards.config import RewardFunctionCfg
    from rlserve.rewards.loader import load_function

    if target == "default":
        connect(cluster)
        config = current_config(cluster)
        app = next(a for a in config["applications"] if a["name"] == "reward")
        app["args"] = app_args(cluster.cfg, "reward", cluster.runs_dir)
        deploy(cluster, config, only=["reward"])
        return app
    path_part, _, attr = target.partition(":")
    if path_part.endswith(".py"):
        source = Path(path_part).expanduser().resolve()
        if not source.is_file():
            raise ValueError(f"{target}: no such file")
        # Copied beside the cluster state so the deployed import path keeps working.
        dest = cluster.state_dir / "rewards" / f"{args_version({'file': source.read_text()})}_{source.name}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, dest)
        import_path = f"{dest}:{attr or 'reward'}"
        name = source.stem
    else:
        import_path = target
        name = (attr or target).rsplit(".", 1)[-1]
    load_function(RewardFunctionCfg(name=name, import_path=import_path))  # fail here, not in a replica
    connect(cluster)
    config = current_config(cluster)
    app = next(a for a in config["applications"] if a["name"] == "reward")
    app["args"]["functions"] = [{"name": name, "import_path": import_path, "weight": 1.0}]
    deploy(cluster, config, only=["reward"])
    return app


__all__ = ["APPS", "Cluster", "connect", "current_config", "deploy", "down", "kill_node", "node_status",
           "served_engine", "start_node", "status", "swap_reward", "up"]
