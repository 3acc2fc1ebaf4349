"""Sessions, models, samplers and checkpoints of the Tinker API, per user.

- A session (`create_session`) is a client's; it lives while its heartbeats come (`heartbeat_timeout_s`),
  and when they stop, or at `sessions/{id}/finish`, its models end (and its models still waiting to start
  stop waiting).
- A model (`create_model`) is a LoRA adapter of any rank on a base the cluster maps from a name to a
  folder or preset (`TinkerConfig.bases`), trained through the learner's primitives as a session of its
  own (`Trainer`); its id is the SDK's `{session}:train:{seq}`. Each model is a run of its user
  (`ModelRuns`, run id `{user}.tinker-{session}-train-{seq}`): it waits for the user's quota and the
  cluster's capacity like any run (its future says so), it is cancelled like any run, and what it spends is
  metered into the run's usage. It ends on `unload_model`, with its session, or when its run is cancelled.
- A sampler (`create_sampling_session`, or `save_weights_for_sampler` without a name) samples the base
  or a saved adapter (`Sampler`); its spend is the model's that saved it, while that model is open (else
  the session's open model, if any).
- A checkpoint is `tinker://{model}/weights/{name}` (`save_state`: adapter, optimizer and version) or
  `tinker://{model}/sampler_weights/{name}` (the adapter a sampler serves), a folder in the model's own
  run directory (`{runs_dir}/{run id}/tinker/{kind}/{name}`) with its metadata and expiry (`ttl_seconds`).
Another user's session, model, sampler, future or path answers exactly as a missing one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlserve.config import RunSpec, parse_spec
from rlserve.models import PRESETS, model_cache_dir, resolve_model
from rlserve.security.principal import Principal
from rlserve.tinker import wire
from rlserve.tinker.backends import Deployment, ModelRuns, Sampler, Trainer, WaitReason
from rlserve.tinker.futures import Future, FutureTable, Ordering, UserError
from rlserve.tinker.wire import FwdBwdRequest, field_of
from rlserve.training.primitives import DatumBatch

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_MODEL_ID = re.compile(r"^[a-z][a-z0-9_-]{0,31}-[0-9a-f]{12}:train:[0-9]{1,9}$")
# What a model has spent is written to its run's events at every optim_step, at its end, and at least this
# often while it only samples.
METER_EVERY_S = 30.0


class TinkerConfig(BaseModel):
    """The Tinker API's settings (the coordinator's `tinker` arg in the cluster file)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The SDK's base model names -> a model folder or `preset:NAME`. On a cluster a base must be the model the
    # rollout deploys (adapters are served on it); empty: that model, named `rlserve/<preset or folder name>`.
    bases: dict[str, str] = {}
    # The learner's precision for the models' sessions.
    precision: Literal["float32", "bfloat16"] = "float32"
    # The highest LoRA rank a model may have (on a cluster also the rollout's `max_lora_rank`).
    max_lora_rank: int = Field(256, ge=1, le=1024)
    # What one request may hold.
    max_datum_tokens: int = Field(8192, ge=1)
    max_datums: int = Field(4096, ge=1)
    max_samples: int = Field(128, ge=1)
    max_top_logprobs: int = Field(20, ge=0)
    # A session without a heartbeat this long ends with its models.
    heartbeat_timeout_s: float = Field(120.0, gt=0)
    # A finished future is answered this long.
    future_keep_s: float = Field(3600.0, gt=0)
    train_micro_batch_size: int = Field(8, ge=1)


# Tinker's LoRA scale numerator (alpha 32 at every rank).
LORA_ALPHA = 32.0


@dataclass
class Session:
    session_id: str
    owner: str
    last_seen: float
    models: list[str] = field(default_factory=list)
    starting: set[Future] = field(default_factory=set)  # create/load futures still waiting to start a model


@dataclass
class Model:
    model_id: str
    owner: str
    session_id: str
    base: str
    rank: int
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    user_metadata: dict[str, str] | None
    ordering: Ordering = field(default_factory=Ordering)
    last_request: float = field(default_factory=time.time)
    version: int = 0
    world_size: int = 1
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set: the model is to end
    done: asyncio.Event = field(default_factory=asyncio.Event)  # set: it ended (its learner session released)
    spent: dict[str, float] = field(default_factory=dict)  # usage/* since the last meter
    metered_at: float = field(default_factory=time.monotonic)

    @property
    def run_id(self) -> str:
        return run_id_of(self.owner, self.model_id)


def run_id_of(owner: str, model_id: str) -> str:
    return f"{owner}.tinker-{model_id.replace(':', '-')}"


@dataclass
class SamplingSession:
    sampling_session_id: str
    owner: str
    session_id: str
    base: str
    adapter: Path | None  # None: the base model
    model_path: str | None
    charge: str | None  # the model whose saved weights it serves (its spend is that model's)
    ordering: Ordering = field(default_factory=Ordering)


@dataclass
class Recorded:
    """What a sampler recorded of a sampled sequence (stable_reinforce reads the sampler's own logprobs)."""

    owner: str
    tokens: list[int]
    logprobs: list[float]


def default_bases(model: Path) -> dict[str, str]:
    """The deployed model under the SDK's name for it: `rlserve/<preset>` for a generated preset, else
    `rlserve/<folder name>`."""
    for name in PRESETS:
        if model.resolve() == (model_cache_dir() / f"{name}-seed0").resolve():
            return {f"rlserve/{name}": f"preset:{name}"}
    return {f"rlserve/{model.name}": str(model)}


class TinkerService:
    def __init__(self, cfg: TinkerConfig, runs_dir: Path, trainer: Trainer, sampler: Sampler, runs: ModelRuns,
                 deployment: Callable[[], Awaitable[Deployment]] | None = None):
        """`deployment`: on a cluster, what its rollout serves (read at the first call): the bases are that model
        (those of `cfg.bases` that are it, or it under its default name), ranks at most its `max_lora_rank`."""
        self.cfg, self.runs_dir = cfg, runs_dir
        self.trainer, self.sampler, self.runs = trainer, sampler, runs
        self._deployment = deployment
        self.bases, self.max_rank, self.unservable = dict(cfg.bases), cfg.max_lora_rank, ""
        self.futures = FutureTable(cfg.future_keep_s)
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self.recorded: dict[str, Recorded] = {}
        self._keys: dict[tuple[str, str, int], str] = {}  # (owner, model or sampler, seq id) -> request id
        self._vocab_sizes: dict[str, int] = {}
        self._reaper: asyncio.Task | None = None

    async def ready(self) -> None:
        """Once: what the cluster's rollout serves decides the bases and the highest rank."""
        if self._deployment is None:
            return
        deployed = await self._deployment()
        self._deployment = None
        served = {n: w for n, w in self.bases.items() if resolve_model(w).resolve() == deployed.model.resolve()}
        self.bases = served or default_bases(deployed.model)
        self.max_rank = min(self.max_rank, deployed.max_lora_rank)
        if not deployed.lora:
            self.unservable = "this cluster's rollout serves without LoRA adapters (its args' enable_lora)"

    # --- sessions -----------------------------------------------------------------------------

    def create_session(self, owner: str) -> str:
        self._start_reaper()
        sid = f"{owner}-{uuid.uuid4().hex[:12]}"
        self.sessions[sid] = Session(sid, owner, time.monotonic())
        return sid

    def _session(self, owner: str, sid: str) -> Session:
        session = self.sessions.get(sid)
        if session is None or session.owner != owner:
            raise UserError("session_id", f"no session {sid!r}", missing=True)
        return session

    def heartbeat(self, owner: str, sid: str) -> bool:
        """False when the session has ended (the SDK's 410)."""
        session = self.sessions.get(sid)
        if session is None or session.owner != owner:
            return False
        session.last_seen = time.monotonic()
        return True

    async def finish_session(self, owner: str, sid: str) -> None:
        await self._end_session(self._session(owner, sid))

    async def _end_session(self, session: Session) -> None:
        self.sessions.pop(session.session_id, None)
        for future in list(session.starting):
            if future.task is not None:
                future.task.cancel()
        for sid in [k for k, s in self.samplers.items() if s.session_id == session.session_id]:
            del self.samplers[sid]
        await asyncio.gather(*(self._end_model(self.models[m]) for m in list(session.models) if m in self.models))

    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        """Sessions whose heartbeats stopped end with their models."""
        while True:
            await asyncio.sleep(min(10.0, self.cfg.heartbeat_timeout_s / 4))
            now = time.monotonic()
            for session in [s for s in self.sessions.values() if now - s.last_seen > self.cfg.heartbeat_timeout_s]:
                await self._end_session(session)

    # --- the futures of a model's calls, in seq-id order, idempotent on retries -----------------

    def ordered(self, owner: str, key: str, ordering: Ordering, seq_id: int, work) -> Future:
        """A future for call `seq_id` of `key` (a model or sampler); a seq id seen before gets its future."""
        seen = self._keys.get((owner, key, seq_id))
        if seen is not None and self.futures.get(owner, seen) is not None:
            return self.futures.get(owner, seen)

        async def run(future: Future):
            await ordering.wait_turn(seq_id)
            await ordering.started(seq_id)
            return await work(future)

        future = self.futures.submit(owner, run)
        self._keys[(owner, key, seq_id)] = future.request_id
        return future

    # --- models -------------------------------------------------------------------------------

    def base_path(self, name: str) -> Path:
        where = self.bases.get(name)
        if where is None:
            raise UserError("base_model", f"{name!r} is not a base model of this cluster (it serves: "
                                          f"{', '.join(sorted(self.bases))})")
        return resolve_model(where)

    def vocab_size(self, base: str) -> int:
        size = self._vocab_sizes.get(base)
        if size is None:
            size = self._vocab_sizes[base] = json.loads((self.base_path(base) / "config.json").read_text())["vocab_size"]
        return size

    def model(self, owner: str, model_id: str) -> Model:
        model = self.models.get(model_id)
        if model is None or model.owner != owner:
            raise UserError("model_id", f"no model {model_id!r}", missing=True)
        model.last_request = time.time()
        return model

    def _spec(self, model: Model) -> RunSpec:
        targets = ([] if not model.train_attn else ["q_proj", "k_proj", "v_proj", "o_proj"]) + \
                  ([] if not model.train_mlp else ["gate_proj", "up_proj", "down_proj"])
        lora = {"enabled": True, "dim": model.rank, "alpha": LORA_ALPHA, "dropout": 0.0,
                "match_all_linear": not targets, "target_modules": targets}
        return parse_spec({"name": "tinker", "policy": {
            "model_name": self.bases[model.base], "precision": self.cfg.precision,
            "dtensor_cfg": {"lora_cfg": lora}, "train_micro_batch_size": self.cfg.train_micro_batch_size,
            "optimizer": {"kwargs": {"weight_decay": 0.0, "eps": 1e-12, "betas": [0.9, 0.95]}}}})

    async def _start_model(self, caller: Principal, model: Model, future: Future, session: Session,
                           init_adapter: Path | None, state: Path | None) -> None:
        """The model's run (waiting for the user's quota and the cluster's capacity), then its learner session
        (from `init_adapter`'s weights, or `state` with the optimizer)."""
        def waiting(reason: WaitReason, message: str) -> None:
            future.queue_state = "paused_rate_limit" if reason == "quota" else "paused_capacity"
            future.queue_state_reason = message

        async def body() -> None:
            try:
                await model.ended.wait()
            finally:
                self._forget(model)
                with contextlib.suppress(Exception):  # a learner that is gone has nothing to release
                    await self.trainer.release(model.run_id)
                model.done.set()

        session.starting.add(future)
        try:
            await self.runs.open(caller, model.run_id, self._spec(model), body, waiting)
        finally:
            session.starting.discard(future)
            future.queue_state, future.queue_state_reason = "active", None
        try:
            base = self.base_path(model.base)
            model.world_size = await self.trainer.configure(model.run_id, self._spec(model), base, init_adapter)
            if state is not None:
                model.version = await self.trainer.load(model.run_id, state)
        except BaseException:
            model.ended.set()
            raise
        if session.session_id not in self.sessions:  # the session ended meanwhile
            model.ended.set()
            raise UserError("session_id", f"no session {session.session_id!r}", missing=True)
        self.models[model.model_id] = model
        session.models.append(model.model_id)

    def _forget(self, model: Model) -> None:
        """The model leaves the tables, and what it spent since the last meter is metered."""
        if self.models.get(model.model_id) is model:
            del self.models[model.model_id]
        session = self.sessions.get(model.session_id)
        if session is not None and model.model_id in session.models:
            session.models.remove(model.model_id)
        self._keys = {k: v for k, v in self._keys.items() if k[1] != model.model_id}
        self._meter(model, {}, force=True)

    async def _end_model(self, model: Model) -> None:
        model.ended.set()
        await model.done.wait()

    def _rank(self, lora: dict[str, Any]) -> tuple[int, dict[str, bool]]:
        if self.unservable:
            raise UserError("base_model", self.unservable)
        rank = lora.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= self.max_rank:
            raise UserError("lora_config.rank", f"must be an integer in [1, {self.max_rank}] (this cluster's "
                                                f"highest), got {rank!r}")
        flags = {k: bool(lora.get(k, True)) for k in ("train_mlp", "train_attn", "train_unembed")}
        if not any(flags.values()):
            raise UserError("lora_config", "one of train_mlp, train_attn, train_unembed must be true")
        return rank, flags

    def create_model(self, caller: Principal, body: dict[str, Any]) -> Future:
        owner = caller.name
        sid = field_of(body, "session_id", str)
        seq = field_of(body, "model_seq_id", int)
        base = field_of(body, "base_model", str)
        lora = field_of(body, "lora_config", dict, required=False, default={"rank": 32})
        session = self._session(owner, sid)
        model_id = f"{sid}:train:{seq}"

        async def work(future: Future):
            rank, flags = self._rank(lora)
            self.base_path(base)
            optimizer = body.get("optimizer_config") or {"type": "adamw"}
            if not isinstance(optimizer, dict) or optimizer.get("type", "adamw") != "adamw":
                raise UserError("optimizer_config.type", "this server trains with adamw only")
            if model_id not in self.models:
                model = Model(model_id, owner, sid, base, rank, flags["train_mlp"], flags["train_attn"],
                              flags["train_unembed"], body.get("user_metadata"))
                await self._start_model(caller, model, future, session, None, None)
            return {"model_id": model_id, "type": "create_model"}

        return self.ordered(owner, f"create:{model_id}", Ordering(), 1, work)

    def info(self, owner: str, model_id: str) -> dict[str, Any]:
        model = self.model(owner, model_id)
        return {"type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": model.rank,
                "model_name": model.base, "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": "causal_lm", "model_name": model.base,
                               "tokenizer_id": str(self.base_path(model.base))}}

    async def unload(self, owner: str, model_id: str) -> dict[str, Any]:
        await self._end_model(self.model(owner, model_id))
        return {"model_id": model_id, "type": "unload_model"}

    # --- metering -----------------------------------------------------------------------------

    def _meter(self, model: Model, spent: dict[str, float], version: int | None = None, force: bool = False) -> None:
        for key, value in spent.items():
            model.spent[key] = model.spent.get(key, 0.0) + value
        now = time.monotonic()
        if version is not None or force or now - model.metered_at > METER_EVERY_S:
            if model.spent or version is not None:
                self.runs.meter(model.run_id, model.spent, version)
            model.spent, model.metered_at = {}, now

    # --- the primitives -----------------------------------------------------------------------

    def forward_backward(self, owner: str, raw: bytes, encoding: str | None) -> Future:
        msg = wire.parse_forward_backward(raw, encoding)
        model = self.model(owner, msg.model_id)
        try:
            req: FwdBwdRequest | UserError = wire.read_datums(msg, self.vocab_size(model.base),
                                                              self.cfg.max_datum_tokens, self.cfg.max_datums)
        except UserError as err:
            req = err  # fails in the call's turn, keeping the order of the calls after it

        async def work(future: Future):
            if isinstance(req, UserError):
                raise req
            batch = DatumBatch(req.datums, req.loss, req.config)
            if req.loss == "stable_reinforce":
                self._fill_recorded(owner, req)
            result = await self.trainer.forward(model.run_id, batch, backward=not req.forward_only)
            self._meter(model, {"usage/trained_tokens": 0.0 if req.forward_only else float(batch.num_tokens),
                                "usage/training_device_s": result.metrics.get("perf/seconds", 0.0) * model.world_size})
            return wire.forward_backward_output(result.logprobs, {"loss:sum": result.metrics["loss:sum"]})

        return self.ordered(owner, msg.model_id, model.ordering, msg.seq_id, work)

    def _fill_recorded(self, owner: str, req: FwdBwdRequest) -> None:
        """stable_reinforce: the sampler's own logprobs of the sampled rows (prompt rows carry none)."""
        import torch

        for i, (datum, spans) in enumerate(zip(req.datums, req.target_spans)):
            q = torch.zeros(len(datum.targets))
            sampled = torch.zeros(len(datum.targets))
            row = 0
            for sequence_id, offset, length, is_sampled in spans:
                if is_sampled:
                    rec = self.recorded.get(sequence_id)
                    if rec is None or rec.owner != owner:
                        raise UserError(f"data[{i}].loss_fn_input_spans", f"no recorded sequence {sequence_id!r} "
                                        f"(sample with record_stability_info)")
                    if offset + length > len(rec.tokens) or \
                            rec.tokens[offset:offset + length] != datum.targets[row:row + length].tolist():
                        raise UserError(f"data[{i}].loss_fn_inputs.target_tokens", f"rows {row}..{row + length} "
                                        f"are not the tokens sequence {sequence_id!r} sampled")
                    q[row:row + length] = torch.tensor(rec.logprobs[offset:offset + length])
                    sampled[row:row + length] = 1.0
                row += length
            datum.inputs["logprobs"], datum.inputs["weights"] = q, sampled * (datum.inputs["advantages"] != 0)

    def optim_step(self, owner: str, body: dict[str, Any]) -> Future:
        model_id = field_of(body, "model_id", str)
        seq_id = field_of(body, "seq_id", int)
        model = self.model(owner, model_id)
        params = body.get("adam_params") or body.get("optim_params") or body.get("optimizer_params")

        async def work(future: Future):
            result = await self.trainer.optim_step(model.run_id, wire.adam(params))
            model.version = result.version
            self._meter(model, {"usage/training_device_s": result.metrics.get("perf/seconds", 0.0) * model.world_size},
                        version=result.version)
            return {"type": "optim_step", "metrics": {k: v for k, v in result.metrics.items() if k != "perf/seconds"}}

        return self.ordered(owner, model_id, model.ordering, seq_id, work)

    # --- checkpoints --------------------------------------------------------------------------

    def _folder(self, owner: str, model_id: str, kind: str, name: str) -> Path:
        return self.runs_dir / run_id_of(owner, model_id) / "tinker" / kind / name

    def resolve_path(self, owner: str, path: str, field_name: str = "path") -> tuple[Path, dict[str, Any]]:
        """The folder and metadata of the caller's `tinker://` checkpoint (another user's: missing)."""
        m = re.fullmatch(r"tinker://([^/]+)/(weights|sampler_weights)/([^/]+)", path or "")
        if m is None or not _MODEL_ID.match(m.group(1)) or not _NAME.match(m.group(3)):
            raise UserError(field_name, f"{path!r} is not a tinker:// checkpoint path "
                                        f"(tinker://MODEL/weights/NAME or .../sampler_weights/NAME)")
        folder = self._folder(owner, m.group(1), m.group(2), m.group(3))
        meta = folder / "checkpoint.json"
        if not meta.is_file():
            raise UserError(field_name, f"no checkpoint {path!r}", missing=True)
        info = json.loads(meta.read_text())
        if info.get("expires_at") is not None and info["expires_at"] < time.time():
            shutil.rmtree(folder, ignore_errors=True)
            raise UserError(field_name, f"no checkpoint {path!r} (it expired)", missing=True)
        return folder, info

    def save(self, owner: str, body: dict[str, Any], for_sampler: bool) -> Future:
        model_id = field_of(body, "model_id", str)
        seq_id = field_of(body, "seq_id", int)
        model = self.model(owner, model_id)
        name = field_of(body, "path", str, required=False)
        ttl = field_of(body, "ttl_seconds", int, required=False)
        sampler_seq = field_of(body, "sampling_session_seq_id", int, required=False)

        async def work(future: Future):
            if ttl is not None and not 1 <= ttl <= 10 * 365 * 86400:
                raise UserError("ttl_seconds", f"must be in [1, {10 * 365 * 86400}], got {ttl}")
            label = name if name is not None else f"ephemeral-{model.version}-{uuid.uuid4().hex[:8]}"
            if not _NAME.match(label):
                raise UserError("path", f"{label!r}: a checkpoint name is 1-128 letters, digits, '.', '_', '-'")
            kind = "sampler_weights" if for_sampler else "weights"
            folder = self._folder(owner, model_id, kind, label)
            if folder.exists() and not body.get("overwrite") and name is not None and not for_sampler:
                raise UserError("path", f"checkpoint {label!r} exists (save with overwrite=True)")
            shutil.rmtree(folder, ignore_errors=True)
            folder.parent.mkdir(parents=True, exist_ok=True)
            await self.trainer.save(model.run_id, folder / "state", folder / "adapter")
            if for_sampler:
                shutil.rmtree(folder / "state", ignore_errors=True)
            meta = {"model_id": model_id, "kind": kind, "name": label, "base": model.base, "rank": model.rank,
                    "version": model.version, "created": time.time(), "user_metadata": body.get("user_metadata"),
                    "expires_at": None if ttl is None else time.time() + ttl, "ephemeral": name is None,
                    "lora": {"train_mlp": model.train_mlp, "train_attn": model.train_attn,
                             "train_unembed": model.train_unembed}}
            (folder / "checkpoint.json").write_text(json.dumps(meta))
            path = f"tinker://{model_id}/{kind}/{label}"
            if for_sampler and name is None:
                sid = self._new_sampler(owner, model.session_id, model.base, folder / "adapter", path, sampler_seq,
                                        model_id)
                return {"type": "save_weights_for_sampler", "sampling_session_id": sid}
            return {"type": "save_weights_for_sampler" if for_sampler else "save_weights", "path": path}

        return self.ordered(owner, model_id, model.ordering, seq_id, work)

    def load(self, caller: Principal, body: dict[str, Any]) -> Future:
        """`load_state` onto an existing model (model_id, seq_id), or a new model from a checkpoint
        (`create_training_client_from_state`: session_id, model_seq_id)."""
        owner = caller.name
        path = field_of(body, "path", str)
        optimizer = bool(body.get("optimizer"))
        if body.get("model_id") is not None:
            model = self.model(owner, field_of(body, "model_id", str))
            key, ordering, seq_id, session = model.model_id, model.ordering, field_of(body, "seq_id", int), None
        else:
            session = self._session(owner, field_of(body, "session_id", str))
            seq = field_of(body, "model_seq_id", int)
            model, key, ordering, seq_id = None, f"{session.session_id}:train:{seq}", Ordering(), 1

        async def work(future: Future):
            folder, meta = self.resolve_path(owner, path)
            if meta["kind"] != "weights":
                raise UserError("path", f"{path!r} holds sampler weights; load_state takes a save_state path")
            state, adapter = (folder / "state", None) if optimizer else (None, folder / "adapter")
            if model is None:
                if key not in self.models:
                    lora = meta.get("lora", {})
                    new = Model(key, owner, session.session_id, body.get("base_model") or meta["base"], meta["rank"],
                                lora.get("train_mlp", True), lora.get("train_attn", True),
                                lora.get("train_unembed", True), body.get("user_metadata"))
                    self.base_path(new.base)
                    await self._start_model(caller, new, future, session, adapter, state)
                return {"type": "load_weights", "path": path, "model_id": key}
            if (model.base, model.rank) != (meta["base"], meta["rank"]):
                raise UserError("path", f"{path!r} is a rank-{meta['rank']} adapter of {meta['base']}; this model "
                                        f"is rank {model.rank} on {model.base}")
            await self.trainer.configure(model.run_id, self._spec(model), self.base_path(model.base), adapter)
            model.version = await self.trainer.load(model.run_id, state) if state is not None else 0
            return {"type": "load_weights", "path": path, "model_id": key}

        return self.ordered(owner, f"create:{key}" if model is None else key, ordering, seq_id, work)

    def checkpoints(self, owner: str, model_id: str) -> list[dict[str, Any]]:
        root = self.runs_dir / run_id_of(owner, model_id) / "tinker"
        if not root.is_dir() and model_id not in {m.model_id for m in self.models.values() if m.owner == owner}:
            raise UserError("training_run_id", f"no training run {model_id!r}", missing=True)
        out = []
        for meta_file in sorted(root.glob("*/*/checkpoint.json"), key=lambda p: p.stat().st_mtime):
            meta = json.loads(meta_file.read_text())
            if meta.get("ephemeral"):  # a sampler's weights without a name (save_weights_and_get_sampling_client)
                continue
            path = f"tinker://{model_id}/{meta['kind']}/{meta['name']}"
            try:
                self.resolve_path(owner, path)
            except UserError:
                continue  # expired
            out.append({"checkpoint_id": f"{meta['kind']}/{meta['name']}",
                        "checkpoint_type": "training" if meta["kind"] == "weights" else "sampler",
                        "time": _iso(meta["created"]), "tinker_path": path,
                        "size_bytes": sum(f.stat().st_size for f in meta_file.parent.rglob("*") if f.is_file()),
                        "user_metadata": meta.get("user_metadata"),
                        "expires_at": None if meta.get("expires_at") is None else _iso(meta["expires_at"])})
        return out

    def delete_checkpoint(self, owner: str, model_id: str, kind: str, name: str) -> None:
        folder, _ = self.resolve_path(owner, f"tinker://{model_id}/{kind}/{name}", "checkpoint_id")
        shutil.rmtree(folder, ignore_errors=True)

    def training_runs(self, owner: str) -> list[dict[str, Any]]:
        ids = {m.model_id for m in self.models.values() if m.owner == owner}
        ids |= {json.loads(p.read_text())["model_id"]
                for p in self.runs_dir.glob(f"{owner}.tinker-*/tinker/*/*/checkpoint.json")}
        return [self.training_run(owner, i) for i in sorted(ids)]

    def training_run(self, owner: str, model_id: str) -> dict[str, Any]:
        ckpts = self.checkpoints(owner, model_id)
        model = self.models.get(model_id)
        model = model if model is not None and model.owner == owner else None
        meta = next((json.loads(p.read_text()) for p in (self.runs_dir / run_id_of(owner, model_id) / "tinker")
                     .glob("*/*/checkpoint.json")), {})
        train = [c for c in ckpts if c["checkpoint_type"] == "training"]
        samp = [c for c in ckpts if c["checkpoint_type"] == "sampler"]
        return {"training_run_id": model_id, "base_model": model.base if model else meta.get("base", ""),
                "model_owner": owner, "is_lora": True, "lora_rank": model.rank if model else meta.get("rank"),
                "last_request_time": _iso(model.last_request if model else meta.get("created", time.time())),
                "last_checkpoint": train[-1] if train else None,
                "last_sampler_checkpoint": samp[-1] if samp else None,
                "user_metadata": model.user_metadata if model else None}

    def weights_info(self, owner: str, path: str) -> dict[str, Any]:
        _, meta = self.resolve_path(owner, path, "tinker_path")
        lora = meta.get("lora", {})
        return {"base_model": meta["base"], "is_lora": True, "lora_rank": meta["rank"], **lora}

    # --- sampling -----------------------------------------------------------------------------

    def _new_sampler(self, owner: str, session_id: str, base: str, adapter: Path | None, model_path: str | None,
                     seq: int | None, charge: str | None) -> str:
        sid = f"{session_id}:sample:{seq if seq is not None else uuid.uuid4().hex[:8]}"
        self.samplers[sid] = SamplingSession(sid, owner, session_id, base, adapter, model_path, charge)
        return sid

    def create_sampler(self, owner: str, body: dict[str, Any]) -> str:
        session = self._session(owner, field_of(body, "session_id", str))
        seq = field_of(body, "sampling_session_seq_id", int)
        model_path = field_of(body, "model_path", str, required=False)
        if model_path is not None:
            folder, meta = self.resolve_path(owner, model_path, "model_path")
            return self._new_sampler(owner, session.session_id, meta["base"], folder / "adapter", model_path, seq,
                                     meta["model_id"])
        base = field_of(body, "base_model", str)
        self.base_path(base)
        return self._new_sampler(owner, session.session_id, base, None, None, seq, None)

    def sampler_info(self, owner: str, sid: str) -> dict[str, Any]:
        s = self._sampler(owner, sid)
        return {"sampler_id": sid, "base_model": s.base, "model_path": s.model_path}

    def _sampler(self, owner: str, sid: str) -> SamplingSession:
        s = self.samplers.get(sid)
        if s is None or s.owner != owner:
            raise UserError("sampling_session_id", f"no sampler {sid!r}", missing=True)
        return s

    def _charged(self, s: SamplingSession) -> Model | None:
        """The model a sampler's spend goes to: the one whose weights it serves, else its session's open one."""
        model = self.models.get(s.charge) if s.charge else None
        if model is not None and model.owner == s.owner:
            return model
        session = self.sessions.get(s.session_id)
        return self.models.get(session.models[-1]) if session is not None and session.models else None

    def sample(self, owner: str, body: dict[str, Any]) -> tuple[Future, list[str]]:
        sid = field_of(body, "sampling_session_id", str)
        seq_id = field_of(body, "seq_id", int)
        s = self._sampler(owner, sid)
        n = field_of(body, "num_samples", int, required=False, default=1)
        ids = [f"{sid}:{seq_id}:{k}" for k in range(max(n, 0))]

        async def work(future: Future):
            if not 1 <= n <= self.cfg.max_samples:
                raise UserError("num_samples", f"must be in [1, {self.cfg.max_samples}], got {n}")
            vocab = self.vocab_size(s.base)
            prompt = wire.prompt_tokens(body.get("prompt"), vocab, self.cfg.max_datum_tokens)
            request = wire.sample_request(body, len(prompt), vocab, self.cfg.max_top_logprobs)
            model = self._charged(s)
            run_id = model.run_id if model is not None else f"{owner}.tinker-sampling"
            out = await self.sampler.sample(run_id, 1.0, s.adapter, prompt, n, request.sampling)
            if model is not None:
                self._meter(model, {"usage/generated_tokens": float(sum(len(x.token_ids) for x in out.samples)),
                                    "usage/generation_device_s": out.engine_seconds})
            if body.get("record_stability_info"):
                for sample_id, sample in zip(ids, out.samples):
                    self.recorded[sample_id] = Recorded(owner, list(sample.token_ids), list(sample.logprobs))
            return wire.sample_response(out.samples, out.prompt_logprobs, out.prompt_top, request)

        return self.ordered(owner, sid, s.ordering, seq_id, work), ids


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat()
