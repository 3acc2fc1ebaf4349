"""Deploy-time resources of one Serve deployment, passed inside each app's builder args.

Keeping them in the builder args (not in code) means one Serve config,
derived from the cluster file, says everything: KubeRay's RayService takes
the same `applications:` list.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from ray import serve

from rlserve import cpu_affinity


class DeploymentArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Required: their defaults live in one place, the cluster file's service section
    # (`rlserve.cluster.config.ServicesCfg`), which `serve_config.app_args` always passes.
    num_replicas: int = Field(ge=1)
    num_cpus: float = Field(ge=0)
    num_gpus: float = Field(ge=0)
    env_vars: dict[str, str] = {}
    # Custom Ray resources per replica (places replicas on the nodes that offer them; the gateway asks
    # for the head node's).
    resources: dict[str, float] = {}
    # Cores the replica's process pins itself to at start (`rlserve.cpu_affinity`); empty: any.
    cpu_cores: list[int] = []
    # Niceness the replica's process takes at start (`rlserve.cpu_affinity`); 0: the control plane's.
    nice: int = Field(0, ge=0, le=19)
    # New replicas start before old ones stop, so a redeploy (a reward swap) drops no request.
    max_surge_percent: int = Field(100, ge=0, le=100)

    def apply(self, deployment: serve.Deployment) -> serve.Deployment:
        actor_options = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            actor_options["resources"] = dict(self.resources)
        runtime_env: dict = {"env_vars": dict(self.env_vars)} if self.env_vars else {}
        if self.cpu_cores:
            runtime_env.setdefault("env_vars", {})[cpu_affinity.ENV] = ",".join(map(str, self.cpu_cores))
        if self.nice:
            runtime_env.setdefault("env_vars", {})[cpu_affinity.NICE_ENV] = str(self.nice)
        if runtime_env:
            actor_options["runtime_env"] = runtime_env
        return deployment.options(num_replicas=self.num_replicas, ray_actor_options=actor_options,
                                  max_surge_percent=self.max_surge_percent)


def assigned_device() -> str:
    """"cuda" when Ray gave this replica or actor a GPU (or a fraction of one: CUDA_VISIBLE_DEVICES then
    names it), else "cpu". A process with num_gpus 0 sees every GPU of its node, so "is CUDA available"
    would put it on a GPU that no one accounted for."""
    import ray

    return "cuda" if ray.get_gpu_ids() else "cpu"


def build_app(deployment: serve.Deployment, args_cls: type[BaseModel], args: dict) -> serve.Application:
    """The body of every app builder: split off `deployment`, validate the rest, bind."""
    args = dict(args)
    resources = DeploymentArgs.model_validate(args.pop("deployment"))
    return resources.apply(deployment).bind(args_cls.model_validate(args).model_dump())
