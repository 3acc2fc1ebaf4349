"""The cluster file: where Ray runs and what each service gets.

The embedded default (`default_cluster.yaml` beside this module, shipped as
package data) is what `deploy/serve` uses when no file is given.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from rlserve.catalog import PluginsCfg
from rlserve.config.errors import SpecError, format_validation_error
from rlserve.tenancy.legacy import CLUSTER_FILE, LegacyKeyError, migrate
from rlserve.tenancy.policy import TenancyPolicy


class ServiceCfg(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(1, ge=1)
    # None: the service's default (DEFAULT_NUM_CPUS).
    num_cpus: float | None = Field(None, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    # GPU memory one replica uses at its peak on each GPU it runs on, GiB: its CUDA context and its caching
    # allocator's reserve included (what nvidia-smi shows), not only what its tensors hold. For the learner:
    # what its workers take of a GPU they share, together (their GPU share comes with each run's spec,
    # `cluster.gpus_per_worker`). `deploy/serve up` refuses a layout whose declared needs on one GPU exceed
    # the card (`rlserve.cluster.gpu_memory`). None: not declared (not checked).
    gpu_memory_gib: float | None = Field(None, gt=0)
    env_vars: dict[str, str] = {}
    # Custom Ray resources each replica needs, e.g. {rollout_slot: 1}: it then runs only on
    # nodes that offer them (see `nodes`).
    resources: dict[str, float] = {}
    # CPU cores each replica's process (and the processes it starts: learner workers) runs on; empty:
    # any. On a CPU-only machine, keep training off the rollout engine's cores (its `args.cpu_cores`).
    cpu_cores: list[Annotated[int, Field(ge=0)]] = Field([], max_length=4096)
    # How much lower than the control plane's its processes' CPU priority is (Linux niceness, 0-19; the
    # learner's workers too); None: the service's default (DEFAULT_NICE). Training and generation then
    # take the CPU time that the gateway, coordinator and reward leave, so calls are not queued behind them.
    nice: int | None = Field(None, ge=0, le=19)
    # Service-specific arguments (see each services/<name>/app.py *Args class).
    args: dict[str, Any] = {}


# Logical CPUs per replica: on a 2-core machine, fractional replicas share the cores.
DEFAULT_NUM_CPUS = {"rollout": 0.5, "reward": 0.1, "reference": 0.25, "learner": 0.1, "coordinator": 0.1}
DEFAULT_NICE = {"rollout": 10, "reward": 0, "reference": 10, "learner": 10, "coordinator": 0}


class ServicesCfg(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rollout: ServiceCfg = ServiceCfg()
    reward: ServiceCfg = ServiceCfg()
    reference: ServiceCfg = ServiceCfg()
    learner: ServiceCfg = ServiceCfg()
    coordinator: ServiceCfg = ServiceCfg()

    @model_validator(mode="after")
    def _default_cpus(self) -> ServicesCfg:
        for name, cpus in DEFAULT_NUM_CPUS.items():
            svc = getattr(self, name)
            if svc.num_cpus is None:
                setattr(self, name, svc.model_copy(update={"num_cpus": cpus}))
        for name, nice in DEFAULT_NICE.items():
            svc = getattr(self, name)
            if svc.nice is None:
                setattr(self, name, svc.model_copy(update={"nice": nice}))
        return self


class NodeCfg(BaseModel):
    """An extra Ray node on this machine, joined to the head (`ray start --address`), on `host`."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    # Logical CPUs it offers; 0 keeps everything that asks for CPUs off it (only replicas that ask
    # for its custom resources go there).
    num_cpus: int = Field(0, ge=0)
    resources: dict[str, float] = {}
    object_store_memory_mb: int = Field(256, ge=78)


class AuthCfg(BaseModel):
    """Who may call the public endpoint: token files (one token a line, the principals `user` and `admin`)
    and the users file (named users, `deploy/serve users`), in files only their owner may read."""

    model_config = ConfigDict(extra="forbid")

    # Users: the run-facing RPCs. None: <runs_dir>/.cluster/token, created by `deploy/serve up`.
    token_file: str | None = None
    # Operators: the run-facing RPCs, and the internal services when `expose_internal` is set.
    # None: <runs_dir>/.cluster/admin_token, created by `deploy/serve up`.
    admin_token_file: str | None = None
    # Named users: `NAME sha256:HEXDIGEST [admin]` a line, written by `deploy/serve users add|revoke`.
    # None: <runs_dir>/.cluster/users.
    users_file: str | None = None


class TlsCfg(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cert_file: str
    key_file: str
    # What `rlserve` trusts for this endpoint; None: cert_file (right for a self-signed certificate).
    ca_file: str | None = None


class RewardPolicyCfg(BaseModel):
    """What a request may name for the reward (built-in functions are always allowed)."""

    model_config = ConfigDict(extra="forbid")

    # Plug-ins by import path: `module:attr` or `path/to/file.py:attr` (attr defaults to `reward`).
    allowed_plugins: list[str] = []
    # External reward servers a spec's `reward.endpoint` may name: host:port patterns (`*` globs).
    allowed_endpoints: list[str] = []
    # Model folders the model-backed built-ins (`reward_model`, `llm_judge`) may load, or folders of
    # them; relative paths: to this file. Generated `preset:` models are always allowed.
    allowed_models: list[str] = []


class RayCfg(BaseModel):
    """Ray's and Serve's own background work, set for a small cluster that is idle most of the time.

    With Ray's and Serve's defaults an idle default cluster took 14-20% of one core, every process polling on
    a clock (`scripts/bench/idle_cluster.py`). Each key is one documented setting, named beside it with Ray's
    or Serve's default; each reaches every process of the cluster (head, nodes, replicas, actors)."""

    model_config = ConfigDict(extra="forbid")

    # `ray start --include-log-monitor` (Ray: true): a process that reads every worker's log files ten times a
    # second to send their new lines to drivers. rlserve's drivers take no worker logs (`log_to_driver: false`):
    # they stay in the session's log files either way.
    log_monitor: bool = False
    # RAY_SERVE_CONTROL_LOOP_INTERVAL_S (Serve: 0.1, doc/source/serve/advanced-guides/performance.md): the pause
    # between the Serve controller's reconciliation loops, each of which also asks the GCS for the nodes.
    # A deploy's steps (a replica started, found ready, running) each wait for the next loop.
    serve_control_loop_interval_s: float = Field(0.5, gt=0, le=10)
    # RAY_SERVE_METRICS_EXPORT_INTERVAL_MS (Serve: 100): how often each replica and each handle hands the
    # request metrics it counted to Ray's metrics (a task that wakes this often whether or not any request
    # came). 0: each request's metrics at once, no task.
    serve_metrics_export_interval_ms: int = Field(10_000, ge=0)
    # RAY_metrics_report_interval_ms (Ray: 10000, src/ray/common/ray_config_def.h): how often every Ray process
    # exports its metrics to the node's dashboard agent. Nothing in rlserve reads them; Prometheus scraping
    # the agent sees them this much later.
    metrics_report_interval_ms: int = Field(60_000, ge=1000)
    # REPORTER_UPDATE_INTERVAL_MS (Ray: 5000, dashboard/modules/reporter/reporter_consts.py): how often the
    # node's dashboard agent reads every process's CPU and memory (psutil) for the dashboard's node view and
    # the node metrics.
    dashboard_agent_report_interval_ms: int = Field(60_000, ge=1000)
    # RAY_num_workers_soft_limit (Ray: -1, as many as the node's CPUs; ray_config_def.h): idle worker processes
    # the node keeps for tasks to come. rlserve runs actors only (replicas, learner workers, the weight store),
    # each in a process of its own, so an idle one only polls; 0: each is stopped a second after it went idle.
    num_workers_soft_limit: int = Field(0, ge=-1)
    # Any other Ray setting for every process of the cluster, e.g. {RAY_event_stats: "0"} (`RAY_<name>` for
    # the names in Ray's ray_config_def.h, and the RAY_SERVE_* variables of Serve's constants).
    env: dict[str, str] = {}

    def env_vars(self) -> dict[str, str]:
        """The environment variables these settings are, for the head, the nodes and every worker."""
        return {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": str(self.serve_control_loop_interval_s),
                "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": str(self.serve_metrics_export_interval_ms),
                "RAY_metrics_report_interval_ms": str(self.metrics_report_interval_ms),
                "REPORTER_UPDATE_INTERVAL_MS": str(self.dashboard_agent_report_interval_ms),
                "RAY_num_workers_soft_limit": str(self.num_workers_soft_limit), **self.env}


class ClusterFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "rlserve"
    # An existing Ray cluster ("host:port"); None: start a local head bound to `host`.
    address: str | None = None
    # Interface for every listener rlserve starts (Ray, Serve's gRPC/HTTP, dashboard).
    # Anything but loopback must be asked for here.
    host: str = "127.0.0.1"
    ray_port: int = Field(6380, gt=0, lt=65536)
    # The public endpoint: rlserve's authenticating gRPC gateway (Serve's own proxies are off).
    grpc_port: int = Field(9000, gt=0, lt=65536)
    # The gateway's HTTP listener on `host`, with the same tokens, limits and TLS: the APIs other ecosystems'
    # clients speak (the OpenAI-compatible endpoint under /v1, `rlserve.agents`). None: no HTTP listener.
    http_port: int | None = Field(9001, gt=0, lt=65536)
    # Ray dashboard on `host` (None: no dashboard).
    dashboard_port: int | None = Field(None, gt=0, lt=65536)
    # Ray's and Serve's own intervals and background processes (`RayCfg`), set for an idle small cluster.
    ray: RayCfg = RayCfg()
    # Logical CPUs of the local head (fractional replicas share real cores); None: all cores.
    num_cpus: int | None = Field(None, ge=1)
    # GPUs the local head offers (replicas ask for fractions of them with `num_gpus`); None: Ray counts
    # the node's GPUs itself.
    num_gpus: int | None = Field(None, ge=0)
    object_store_memory_mb: int = Field(1024, ge=78)
    # PyTorch's CUDA allocator settings (PYTORCH_CUDA_ALLOC_CONF) for every service that uses a GPU (num_gpus > 0
    # or a declared gpu_memory_gib; the learner's workers inherit its replica's). Expandable segments keep a
    # replica's reserve near what it uses: without them, one 1b step's generation left the rollout's allocator
    # holding 70.7 GiB for about 18 GiB in use, and the learner ran out of memory (issue 45). A service's own
    # env_vars win; "": PyTorch's defaults.
    cuda_alloc_conf: str = "expandable_segments:True"
    # Memory of each GPU, GiB, for the check of the services' gpu_memory_gib; None: read from this machine's
    # GPUs at `deploy/serve up` (torch.cuda.get_device_properties; the smallest card), not checked without one.
    gpu_card_gib: float | None = Field(None, gt=0)
    # Where runs, cluster state and logs go. None: ./runs in the working directory;
    # relative paths: to the cluster file.
    runs_dir: str | None = None
    # Extra local nodes started by `up` after the head (none: one node).
    nodes: list[NodeCfg] = []
    # Folders whose HF models a request may name (policy.model_name, a reference model_path, rollout
    # safetensors_path); generated presets and the runs directory are always allowed.
    # None: ./models in the working directory.
    model_dirs: list[str] | None = None
    # Folders a spec's data.train_path / data.val_path may read. None: ./data in the working directory.
    data_dirs: list[str] | None = None
    # "none" turns authentication off (warned at every start); TLS is off unless configured.
    auth: AuthCfg | Literal["none"] = AuthCfg()
    tls: TlsCfg | None = None
    # Also serve Learner, Rollout, Reference and Reward on the public endpoint, to admin tokens only.
    expose_internal: bool = False
    # A user's identical GetRun / ListRuns calls within this long share one answer from the coordinator
    # (rlserve.gateway.read_cache: writes through the gateway are seen at once, a run's own progress within
    # this long); 0: only calls made while the same one is forwarded share it.
    read_cache_ms: int = Field(0, ge=0, le=10_000)
    # CPU cores the gateway's process runs on (the services' own are `services.<name>.cpu_cores`); empty: any.
    # With the control plane (gateway, coordinator, reward) on cores that training does not use, callers take
    # none of training's: on 16 cores, 500 callers left a run's step at 1.04x quiet (BENCHMARKS.md, the soak
    # with --control-cores).
    gateway_cpu_cores: list[Annotated[int, Field(ge=0)]] = Field([], max_length=4096)
    # Every limit on what one party takes of the cluster (rlserve.tenancy.policy): each caller's share of the
    # endpoint, each user's quota on runs, the cluster's runs training and waiting; over one:
    # RESOURCE_EXHAUSTED naming its key. The coordinator re-reads this section when the file changes.
    tenancy: TenancyPolicy = TenancyPolicy()
    reward: RewardPolicyCfg = RewardPolicyCfg()
    # What the cluster loads beyond rlserve's built-ins (rlserve.catalog.PluginsCfg): the packages whose
    # entry points add losses, advantage estimators, environments, reward functions, tasks and rollout
    # engines, and entries by import path. Every service's processes get it (RLSERVE_PLUGINS); empty: the
    # built-ins only.
    plugins: PluginsCfg = PluginsCfg()
    services: ServicesCfg = ServicesCfg()
    # The file this was read from (`load_cluster_file`): the coordinator re-reads its `tenancy` there.
    _source: Path | None = PrivateAttr(None)
    # Old keys of the tenancy limits this was given, each with its new key (`rlserve.tenancy.legacy`).
    _deprecated_keys: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _old_tenancy_keys(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> ClusterFile:
        moved: dict[str, str] = {}
        if isinstance(data, dict):
            data, moved = migrate(data, CLUSTER_FILE)
        cfg = handler(data)
        cfg._deprecated_keys = {**cfg._deprecated_keys, **moved}
        return cfg

    @property
    def source(self) -> Path | None:
        return self._source

    @property
    def deprecated_keys(self) -> dict[str, str]:
        """Old keys this file gives, each with the key that replaces it (`deploy/serve` warns of each)."""
        return dict(self._deprecated_keys)

    @field_validator("nodes")
    @classmethod
    def _unique_names(cls, v: list[NodeCfg]) -> list[NodeCfg]:
        names = [n.name for n in v]
        if len(set(names)) != len(names):
            raise ValueError(f"node names must be unique, got {names}")
        return v

    @property
    def generation_shares_cpu_cores(self) -> bool:
        """The rollout engine generates on the CPU, on cores that a CPU learner also uses: no GPU for it, no
        custom resources placing it on nodes of its own, and no disjoint `cpu_cores` for the engine and the
        learner. What `async_grpo.enabled: auto` decides on."""
        rollout, learner = self.services.rollout, self.services.learner
        if rollout.num_gpus > 0 or rollout.resources:
            return False
        engine = set(rollout.args.get("cpu_cores") or rollout.cpu_cores)
        return not (engine and learner.cpu_cores and engine.isdisjoint(learner.cpu_cores))

    def uses_gpu(self, name: str) -> bool:
        """Whether service `name`'s processes use a GPU: its replicas ask for one, or it declares GPU memory (the
        learner, whose workers take their GPUs by each run's spec)."""
        svc = getattr(self.services, name)
        return svc.num_gpus > 0 or svc.gpu_memory_gib is not None

    @property
    def loopback(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1")

    def resolve(self, path: str, base: Path) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() else (base / p).resolve()

    def with_absolute_paths(self, base: Path) -> ClusterFile:
        """Every path of the file made absolute: relative ones from `base` (the file's folder), unset
        directories in the working directory."""
        def fix(p: str | None) -> str | None:
            return None if p is None else str(self.resolve(p, base))

        def plugin(entry: str) -> str:
            target, sep, attr = entry.partition(":")
            return f"{fix(target)}{sep}{attr}" if target.endswith(".py") else entry

        cwd = Path.cwd()
        update: dict[str, Any] = {
            "runs_dir": fix(self.runs_dir) if self.runs_dir is not None else str(cwd / "runs"),
            "model_dirs": [fix(p) for p in self.model_dirs] if self.model_dirs is not None else [str(cwd / "models")],
            "data_dirs": [fix(p) for p in self.data_dirs] if self.data_dirs is not None else [str(cwd / "data")],
            "reward": self.reward.model_copy(
                update={"allowed_plugins": [plugin(e) for e in self.reward.allowed_plugins],
                        "allowed_models": [fix(p) for p in self.reward.allowed_models]})}
        if isinstance(self.auth, AuthCfg):
            update["auth"] = AuthCfg(token_file=fix(self.auth.token_file),
                                     admin_token_file=fix(self.auth.admin_token_file),
                                     users_file=fix(self.auth.users_file))
        if self.tls is not None:
            update["tls"] = TlsCfg(cert_file=fix(self.tls.cert_file), key_file=fix(self.tls.key_file),
                                   ca_file=fix(self.tls.ca_file))
        return self.model_copy(update=update)


def load_cluster_file(path: Path) -> tuple[ClusterFile, Path]:
    """Parse and validate; errors name the key path. Returns (config with absolute paths, runs dir)."""
    if not path.is_file():
        raise SpecError([f"{path}: no such file"])
    try:
        data = yaml.safe_load(path.read_text()) or {}
        cfg = ClusterFile.model_validate(data)
    except yaml.YAMLError as err:
        raise SpecError([f"<root>: not valid YAML: {err}"]) from None
    except ValidationError as err:
        raise SpecError(format_validation_error(err, ClusterFile) + _moved_keys(data)) from None
    cfg = cfg.with_absolute_paths(path.parent.resolve())
    cfg._source = path.resolve()
    return cfg, Path(cfg.runs_dir)


def _moved_keys(data: Any) -> list[str]:
    """For a file that does not validate: its old keys and where they went, since errors name the new keys."""
    try:
        _, moved = migrate(data, CLUSTER_FILE) if isinstance(data, dict) else (data, {})
    except LegacyKeyError:
        return []
    return [f"{old}: deprecated, read as {new}" for old, new in moved.items()]


def default_cluster_file() -> Path:
    """The embedded default cluster file (package data, so it is found in any kind of install)."""
    return Path(str(resources.files("rlserve.cluster").joinpath("default_cluster.yaml")))
