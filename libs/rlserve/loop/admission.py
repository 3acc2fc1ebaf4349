"""Admission of a run: what SubmitRun checks before queueing it, and the preflight before it starts.

`check` runs on the request path and is cheap: the spec's plug-ins and reward
server are allow-listed, its files lie in the cluster's directories, and in
the runs directory only in the caller's own runs (they are returned as
confined absolute paths), the learner backend can train the
model (from its config alone), and the generation settings match the
deployed rollout (filled in where unset). `preflight` runs off the request
path, within the run manager's `preflight_timeout_s`, and checks what needs
the model or the data: the architecture against the rollout's, prompt
lengths on a bounded sample, the reward functions (or the environment: it
starts an episode, and the chat template can append observations). A run that cannot work
fails there with the field named, before it takes the learner.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from jinja2 import TemplateError

from rlserve.config import RunSpec
from rlserve.data.dataset import build_splits
from rlserve.data.preferences import build_preference_splits
from rlserve.data.prompts import PromptTokenizer
from rlserve.data.tasks import Example
from rlserve.environments.config import SCORED
from rlserve.environments.loader import single_turn_functions
from rlserve.environments.serving import messages_from_proto
from rlserve.learner.lora import LoraMismatch, check_lora
from rlserve.learner.registry import UnsupportedModel, check_model
from rlserve.loop.algorithm import algorithm_class
from rlserve.loop.retry import RetryPolicy
from rlserve.loop.services import Capacity, RunServices, ServiceFailure
from rlserve.models import hf_config, resolve_model
from rlserve.rollout.deployed import match_generation
from rlserve.rpc import failed_precondition, invalid_argument, permission_denied
from rlserve.runs.manager import Admission
from rlserve.security.paths import PathPolicy, RunAccess
from rlserve.security.plugins import PluginPolicy
from rlserve.trajectories.episodes import episode_proto
from rlserve.v1 import environment_pb2, reward_pb2, rollout_pb2
from rlserve.weights.specs import checkpoint_specs, fingerprint

# Prompts whose length the preflight checks (the data set's first ones, and every validation prompt).
PREFLIGHT_SAMPLE = 2000
T = TypeVar("T")
# Services for admission's own calls: (reward endpoint or None, retry policy, environment endpoint or None).
Connect = Callable[[str | None, RetryPolicy, str | None], RunServices]


async def _data_and_tokenizer(spec: RunSpec, model: Path, build: Callable[..., T], *args: Any
                              ) -> tuple[T, PromptTokenizer]:
    """`build(*args)` (the data, off the event loop) and the model's prompt tokenizer; INVALID_ARGUMENT
    naming `data` for data that cannot be read, FAILED_PRECONDITION for a tokenizer that cannot render it."""
    try:
        data = await asyncio.to_thread(build, *args)
    except ValueError as err:
        raise invalid_argument("data", str(err)) from None
    try:
        return data, PromptTokenizer(model, spec.data.prompt_format, spec.data.system_prompt)
    except ValueError as err:
        raise failed_precondition(str(err)) from None


class RunAdmission(Admission):
    def __init__(self, paths: PathPolicy, plugins: PluginPolicy, allowed_endpoints: list[str],
                 max_data_file_mb: int, connect: Connect):
        self.paths, self.plugins = paths, plugins
        self.allowed_endpoints = allowed_endpoints
        self.max_data_file_mb = max_data_file_mb
        self.connect = connect

    async def check(self, spec: RunSpec, run_access: RunAccess | None) -> RunSpec:
        self._check_plugins(spec)
        spec = spec.model_copy(deep=True)
        paths = self.paths.for_runs(run_access)
        spec.policy.model_name = paths.model_name("spec_yaml: policy.model_name", spec.policy.model_name)
        if spec.teacher.model_name is not None:
            spec.teacher.model_name = paths.model_name("spec_yaml: teacher.model_name", spec.teacher.model_name)
        try:
            config = await asyncio.to_thread(hf_config, spec.policy.model_name)
        except (OSError, ValueError) as err:
            raise invalid_argument("spec_yaml: policy.model_name", str(err)) from None
        try:
            check_model(spec, config)
        except UnsupportedModel as err:
            raise failed_precondition(str(err)) from None
        try:
            await asyncio.to_thread(check_lora, spec, config)
        except LoraMismatch as err:
            raise invalid_argument(f"spec_yaml: {err.field}", err.reason) from None
        self._confine_data(spec, paths)
        services = self.connect(None, RetryPolicy(retries=1, timeout_s=30), None)
        try:
            info = await services.rollout_info()
            capacity = await services.capacity()
        except ServiceFailure as err:
            raise failed_precondition(f"the rollout service does not answer: {err}") from None
        finally:
            await services.close()
        self._check_resources(spec, capacity)
        spec, problems = match_generation(spec, info)
        if problems:
            raise failed_precondition("; ".join(problems))
        if info.max_model_len < spec.policy.max_total_sequence_length:
            raise failed_precondition(f"policy.max_total_sequence_length {spec.policy.max_total_sequence_length}"
                                      f" exceeds the rollout's max_model_len {info.max_model_len}")
        self._check_lora_serving(spec, info)
        self._check_routing_replay(spec, config, info)
        return spec

    @staticmethod
    def _check_routing_replay(spec: RunSpec, config: Any, info: rollout_pb2.GetInfoResponse) -> None:
        """Routing replay needs a Mixtral- or Qwen3-MoE-shaped model and a rollout engine that records routing."""
        if not spec.policy.routing_replay:
            return
        if config.model_type not in ("mixtral", "qwen3_moe"):
            raise invalid_argument("spec_yaml: policy.routing_replay", f"replays Mixtral- and Qwen3-MoE-shaped models' "
                                   f"routing; {spec.policy.model_name} is {config.model_type!r}")
        if info.routing_unavailable:
            raise failed_precondition(f"policy.routing_replay: the rollout's {info.engine} engine cannot record MoE "
                                      f"routing ({info.routing_unavailable})")

    @staticmethod
    def _check_resources(spec: RunSpec, capacity: Capacity) -> None:
        """The learner's workers must fit the cluster (else they would wait for resources that never come)."""
        cl = spec.cluster
        cpus, gpus = cl.num_workers * cl.cpus_per_worker, cl.num_workers * cl.gpus_per_worker
        if cpus > capacity.cpus:
            raise failed_precondition(f"cluster.num_workers x cluster.cpus_per_worker: {cl.num_workers} x "
                                      f"{cl.cpus_per_worker:g} = {cpus:g} CPUs; the cluster has {capacity.cpus:g}")
        if gpus > capacity.gpus:
            raise failed_precondition(f"cluster.num_workers x cluster.gpus_per_worker: {cl.num_workers} x "
                                      f"{cl.gpus_per_worker:g} = {gpus:g} GPUs; the cluster has {capacity.gpus:g}")
        if cl.torch_threads > capacity.node_cpus:
            raise failed_precondition(f"cluster.torch_threads: {cl.torch_threads} threads per worker; a node of "
                                      f"this cluster has at most {capacity.node_cpus:g} CPUs")

    @staticmethod
    def _check_lora_serving(spec: RunSpec, info: rollout_pb2.GetInfoResponse) -> None:
        """A LoRA run needs a rollout that serves adapters of its rank."""
        lora, key = spec.policy.lora, spec.policy.lora_key
        if not lora.enabled:
            return
        if not info.lora_enabled:
            raise failed_precondition(f"{key}.enabled: the rollout service serves without LoRA; an operator can "
                                      f"set enable_lora (and max_lora_rank) in services.rollout.args of the "
                                      f"cluster file")
        if lora.dim > info.max_lora_rank:
            raise invalid_argument(f"spec_yaml: {key}.dim", f"{lora.dim} exceeds the rollout's max_lora_rank "
                                   f"{info.max_lora_rank} (services.rollout.args in the cluster file)")

    def _check_plugins(self, spec: RunSpec) -> None:
        for i, f in enumerate(spec.reward.functions):
            self.plugins.check_function(f"spec_yaml: reward.functions.{i}", f)
        env = spec.env
        if env.import_path:
            self.plugins.check("spec_yaml: env.import_path", env.import_path)
        if env.import_path is None and env.name in SCORED:
            try:
                functions = single_turn_functions(env.environment([]))
            except ValueError as err:
                raise invalid_argument("spec_yaml: env.args", str(err)) from None
            for i, f in enumerate(functions):
                self.plugins.check_function(f"spec_yaml: env.args.functions.{i}", f)
        for key, endpoint in (("reward.endpoint", spec.reward.endpoint), ("env.endpoint", env.endpoint)):
            if endpoint and not any(fnmatch.fnmatchcase(endpoint, pat) for pat in self.allowed_endpoints):
                raise permission_denied(f"spec_yaml: {key}", f"{endpoint!r} is not a server this cluster allows; "
                                        f"an operator can add it to `reward.allowed_endpoints` in the cluster file")

    def _confine_data(self, spec: RunSpec, paths: PathPolicy) -> None:
        for key in ("train_path", "val_path"):
            value = getattr(spec.data, key)
            if value is None:
                continue
            field = f"spec_yaml: data.{key}"
            path = paths.data(field, value)
            if not path.is_file():
                raise invalid_argument(field, f"{value[:200]!r}: no such file")
            if path.stat().st_size > self.max_data_file_mb * 2**20:
                raise invalid_argument(field, f"{value[:200]!r} is larger than {self.max_data_file_mb} MB")
            setattr(spec.data, key, str(path))

    async def preflight(self, spec: RunSpec) -> None:
        try:
            model = await asyncio.to_thread(resolve_model, spec.policy.model_name, spec.policy.model_seed)
        except ValueError as err:
            raise invalid_argument("policy.model_name", str(err).removeprefix("policy.model_name: ")) from None
        if spec.teacher.model_name is not None:
            await self._check_teacher(spec, model)
        example = None
        if algorithm_class(spec).trains_on_pairs:
            await self._check_preference_data(spec, model)
        else:
            example = await self._check_prompt_lengths(spec, model)
        services = self.connect(spec.reward.endpoint, RetryPolicy(retries=1, timeout_s=60),
                                spec.env.endpoint if spec.env.enabled else None)
        try:
            info = await services.rollout_info()
            served = await asyncio.to_thread(lambda: fingerprint(checkpoint_specs(model)))
            if info.architecture_fingerprint != served:
                raise failed_precondition(f"policy.model_name: {spec.policy.model_name} does not have the "
                                          f"architecture of the model the rollout service serves ({info.model})")
            if spec.policy.lora.enabled and not spec.sft.enabled and Path(model).resolve() != Path(info.model).resolve():
                raise failed_precondition(f"policy.model_name: a LoRA run's adapters apply to the base model the "
                                          f"rollout serves ({info.model}); {spec.policy.model_name} is another "
                                          f"(a run with an SFT warm start brings its own base)")
            if spec.env.external_agent and example is not None:
                await self._check_continuation(example[0])
                await services.score(reward_pb2.ScoreRequest(functions=[f.to_proto() for f in spec.reward.functions]))
            elif spec.env.enabled and example is not None:
                await self._check_environment(spec, services, example)
            else:
                await services.score(reward_pb2.ScoreRequest(functions=[f.to_proto() for f in spec.reward.functions]))
        except ServiceFailure as err:
            raise failed_precondition(f"{'env' if spec.env.enabled else 'reward.functions'} or services: "
                                      f"{err}") from None
        finally:
            await services.close()

    @staticmethod
    async def _check_teacher(spec: RunSpec, student: Path) -> None:
        """The teacher scores the student's tokens, so both must read token ids alike: the same vocabulary."""
        try:
            teacher = await asyncio.to_thread(resolve_model, spec.teacher.model_name, spec.teacher.model_seed)
        except ValueError as err:
            raise invalid_argument("teacher.model_name", str(err).removeprefix("policy.model_name: ")) from None
        if teacher.resolve() == student.resolve():
            raise invalid_argument("teacher.model_name", "is the policy itself: a teacher is another model")

        def vocab(path: Path) -> dict[str, int]:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(path).get_vocab()

        theirs, ours = await asyncio.gather(asyncio.to_thread(vocab, teacher), asyncio.to_thread(vocab, student))
        if theirs != ours:
            differ = sorted(set(theirs.items()) ^ set(ours.items()))[:3]
            raise invalid_argument("teacher.model_name", f"its tokenizer differs from policy.model_name's "
                                   f"({len(theirs)} against {len(ours)} tokens; e.g. {differ}): the teacher must "
                                   f"score the student's token ids")

    @staticmethod
    async def _check_preference_data(spec: RunSpec, model: Path) -> None:
        """The preference file of a run that trains on pairs (DPO): every row a pair, a sample of them
        renderable."""
        splits, tok = await _data_and_tokenizer(spec, model, build_preference_splits, spec.data)
        sample = [*splits.train[:PREFLIGHT_SAMPLE], *splits.val]
        try:
            await asyncio.to_thread(lambda: [tok.sft_ids(p.example(r)) for p in sample for r in (p.chosen, p.rejected)])
        except TemplateError as err:
            raise invalid_argument("data.prompt_format", f"the model's chat template fails on this data: "
                                   f"{type(err).__name__}: {err}") from None

    @staticmethod
    async def _check_continuation(tok: PromptTokenizer) -> None:
        """The chat template can append messages after a turn as tokens (multi-turn episodes, agents' calls)."""
        try:
            await asyncio.to_thread(tok.observation_ids, [{"role": "user", "content": "x"}], tok.eos_ids[0])
        except (ValueError, TemplateError) as err:
            raise invalid_argument("data.prompt_format", f"multi-turn episodes need {err}") from None

    @staticmethod
    async def _check_environment(spec: RunSpec, services: RunServices, example: tuple[PromptTokenizer, Example]
                                 ) -> None:
        """The environment starts an episode of the first validation example, and the chat template can
        append its observations as tokens."""
        tok, ex = example
        await RunAdmission._check_continuation(tok)
        try:
            resp = await asyncio.wait_for(services.env_reset(environment_pb2.ResetRequest(
                environment=spec.env.environment(spec.reward.functions).to_proto(),
                episode=episode_proto(tok, ex, "preflight"))), spec.env.timeout_s)
        except asyncio.TimeoutError:
            raise failed_precondition(f"env: the environment's Reset took more than env.timeout_s "
                                      f"({spec.env.timeout_s:g}s)") from None
        if resp.status != environment_pb2.ENVIRONMENT_STATUS_OK:
            raise failed_precondition(f"env: the environment cannot start an episode: {resp.error}")
        if resp.tools_json:
            try:
                await asyncio.to_thread(tok.episode_prompt_ids, messages_from_proto(resp.messages),
                                        json.loads(resp.tools_json))
            except (ValueError, TemplateError) as err:
                raise invalid_argument("policy.model_name", f"{err} (tool_use: declare_tools: system declares "
                                                            f"them in a system message instead)") from None

    @staticmethod
    async def _check_prompt_lengths(spec: RunSpec, model: Path) -> tuple[PromptTokenizer, Example]:
        """Every sampled prompt fits; returns the tokenizer and the first validation example."""
        # A bounded sample: the run builds the whole data set itself, in a worker thread.
        splits, tok = await _data_and_tokenizer(spec, model, build_splits, spec.data, PREFLIGHT_SAMPLE)
        room = spec.policy.max_total_sequence_length - spec.policy.generation.max_new_tokens
        try:
            longest = await asyncio.to_thread(tok.longest_prompt, splits.train + splits.val)
        except TemplateError as err:
            raise invalid_argument("data.prompt_format", f"the model's chat template fails on this data: "
                                   f"{type(err).__name__}: {err}") from None
        if longest > room:
            raise invalid_argument("policy.max_total_sequence_length",
                                   f"a prompt of {longest} tokens + max_new_tokens "
                                   f"{spec.policy.generation.max_new_tokens} do not fit "
                                   f"{spec.policy.max_total_sequence_length}")
        return tok, (splits.val or splits.train)[0]
