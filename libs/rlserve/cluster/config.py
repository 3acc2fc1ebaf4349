"""The cluster file: where Ray runs and what each service gets.

The embedded default (`default_cluster.yaml` beside this module, shipped as
package data) is what `deploy/serve` uses when no file is given.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rlserve.config.errors import SpecError, format_validation_error


class ServiceCfg(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(1, ge=1)
    # None: the service's default (DEFAULT_NUM_CPUS).
    num_cpus: float | None = Field(None, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    env_vars: dict[str, str] = {}
    # Service-specific arguments (see each services/<name>/app.py *Args class).
    args: dict[str, Any] = {}


# Logical CPUs per replica: on a 2-core machine, fractional replicas share the cores.
DEFAULT_NUM_CPUS = {"rollout": 0.5, "reward": 0.1, "reference": 0.25, "learner": 0.1, "coordinator": 0.1}


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
        return self


class ClusterFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "rlserve"
    # An existing Ray cluster ("host:port"); None: start a local head bound to `host`.
    address: str | None = None
    # Interface for every listener rlserve starts (Ray, Serve's gRPC/HTTP, dashboard).
    # Anything but loopback must be asked for here.
    host: str = "127.0.0.1"
    ray_port: int = Field(6380, gt=0, lt=65536)
    grpc_port: int = Field(9000, gt=0, lt=65536)
    http_port: int = Field(8000, gt=0, lt=65536)
    # Ray dashboard on `host` (None: no dashboard).
    dashboard_port: int | None = Field(None, gt=0, lt=65536)
    # Logical CPUs of the local head (fractional replicas share real cores); None: all cores.
    num_cpus: int | None = Field(None, ge=1)
    object_store_memory_mb: int = Field(1024, ge=78)
    # Where runs, cluster state and logs go. None: ./runs in the working directory;
    # relative paths: to the cluster file.
    runs_dir: str | None = None
    services: ServicesCfg = ServicesCfg()

    @property
    def loopback(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1")

    def resolve(self, path: str, base: Path) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() else (base / p).resolve()


def load_cluster_file(path: Path) -> tuple[ClusterFile, Path]:
    """Parse and validate; errors name the key path. Returns (config, runs dir)."""
    if not path.is_file():
        raise SpecError([f"{path}: no such file"])
    try:
        data = yaml.safe_load(path.read_text()) or {}
        cfg = ClusterFile.model_validate(data)
    except yaml.YAMLError as err:
        raise SpecError([f"<root>: not valid YAML: {err}"]) from None
    except ValidationError as err:
        raise SpecError(format_validation_error(err, ClusterFile)) from None
    if cfg.runs_dir is None:
        return cfg, Path.cwd() / "runs"
    return cfg, cfg.resolve(cfg.runs_dir, path.parent.resolve())


def default_cluster_file() -> Path:
    """The embedded default cluster file (package data, so it is found in any kind of install)."""
    return Path(str(resources.files("rlserve.cluster").joinpath("default_cluster.yaml")))
