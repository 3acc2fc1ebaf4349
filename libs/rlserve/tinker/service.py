"""Sessions, models, samplers and checkpoints of the Tinker API, per user.

- A session (`create_session`) is a client's; it lives while its heartbeats come (`heartbeat_timeout_s`),
  and when they stop, or at `sessions/{id}/finish`, its models end.
- A model (`create_model`) is a LoRA adapter of any rank on a base the cluster maps from a name to a
  folder or preset (`TinkerConfig.bases`), trained through the learner's primitives as a session of its
  own (`Trainer`); its id is the SDK's `{session}:train:{seq}`. Each user holds at most `max_models`.
- A sampler (`create_sampling_session`, or `save_weights_for_sampler` without a name) samples the base
  or a saved adapter (`Sampler`).
- A checkpoint is `tinker://{model}/weights/{name}` (`save_state`: adapter, optimizer and version) or
  `tinker://{model}/sampler_weights/{name}` (the adapter a sampler serves), a folder under the user's own
  directory with its metadata and expiry (`ttl_seconds`).
Another user's session, model, sampler, future or path answers exactly as a missing one.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rlserve.config import RunSpec, parse_spec
from rlserve.models import resolve_model
from rlserve.rollout.interfaces import SamplingSpec
from rlserve.tinker.backends import Sampler, Trainer
from rlserve.tinker.futures import Future, FutureTable, Ordering, UserError
from rlserve.tinker.wire import FwdBwdRequest
from rlserve.training.primitives import AdamStep, DatumBatch

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


@dataclass(frozen=True)
class TinkerConfig:
    bases: dict[str, str]  # the SDK's model name -> a folder or `preset:NAME`
    checkpoints_dir: Path  # {dir}/{user}/{model}/{weights|sampler_weights}/{name}
    vocab_sizes: dict[str, int] = field(default_factory=dict)  # filled from the bases' configs
    max_models: int = 4  # per user
    max_datum_tokens: int = 8192
    max_datums: int = 4096
    max_samples: int = 128
    heartbeat_timeout_s: float = 120.0
    device: str = "cpu"
    micro_batch_size: int = 8
    lora_alpha: float = 32.0  # Tinker's LoRA scale numerator


@dataclass
class Session:
    session_id: str
    owner: str
    last_seen: float
    models: list[str] = field(default_factory=list)


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
    trained_tokens: int = 0

    @property
    def run_id(self) -> str:
        return f"{self.owner}.tinker-{self.model_id.replace(':', '-')}"


@dataclass
class SamplingSession:
    sampling_session_id: str
    owner: str
    base: str
    adapter: Path | None  # None: the base model
    model_path: str | None
    ordering: Ordering = field(default_factory=Ordering)
    record: bool = False


@dataclass
class Recorded:
    """What a sampler recorded of a sampled sequence (stable_reinforce reads the sampler's own logprobs)."""

    owner: str
    tokens: list[int]
    logprobs: list[float]


class TinkerService:
    def __init__(self, cfg: TinkerConfig, trainer: Trainer, sampler: Sampler):
        self.cfg, self.trainer, self.sampler = cfg, trainer, sampler
        self.futures = FutureTable()
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self.recorded: dict[str, Recorded] = {}
        self._keys: dict[tuple[str, str, int], str] = {}  # (owner, model or sampler, seq id) -> request id
        self._reaper: asyncio.Task | None = None

    # --- sessions -----------------------------------------------------------------------------

    def create_session(self, owner: str) -> str:
        self._start_reaper()
        sid = f"{owner}-{uuid.uuid4().hex[:12]}"
        self.sessions[sid] = Session(sid, owner, time.monotonic())
        return sid

    def _session(self, owner: str, sid: str) -> Session:
        session = self.sessions.get(sid)
        if session is None or session.owner != owner:
            raise UserError("session_id", f"no session {sid!r}")
        return session

    def heartbeat(self, owner: str, sid: str) -> bool:
        """False when the session has ended (the SDK's 410)."""
        session = self.sessions.get(sid)
        if session is None or session.owner != owner:
            return False
        session.last_seen = time.monotonic()
        return True

    async def finish_session(self, owner: str, sid: str) -> None:
        session = self._session(owner, sid)
        await self._end_session(session)

    async def _end_session(self, session: Session) -> None:
        self.sessions.pop(session.session_id, None)
        for model_id in session.models:
            model = self.models.pop(model_id, None)
            if model is not None:
                await self.trainer.release(model.run_id)

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
        where = self.cfg.bases.get(name)
        if where is None:
            raise UserError("base_model", f"{name!r} is not a base model of this cluster (it serves: "
                                          f"{', '.join(sorted(self.cfg.bases))})")
        return resolve_model(where)

    def vocab_size(self, base: str) -> int:
        size = self.cfg.vocab_sizes.get(base)
        if size is None:
            size = json.loads((self.base_path(base) / "config.json").read_text())["vocab_size"]
            self.cfg.vocab_sizes[base] = size
        return size

    def model(self, owner: str, model_id: str) -> Model:
        model = self.models.get(model_id)
        if model is None or model.owner != owner:
            raise UserError("model_id", f"no model {model_id!r}")
        model.last_request = time.time()
        return model

    def _spec(self, model: Model) -> RunSpec:
        targets = ([] if not model.train_attn else ["q_proj", "k_proj", "v_proj", "o_proj"]) + \
                  ([] if not model.train_mlp else ["gate_proj", "up_proj", "down_proj"])
        lora = {"enabled": True, "dim": model.rank, "alpha": self.cfg.lora_alpha, "dropout": 0.0,
                "match_all_linear": not targets, "target_modules": targets}
        return parse_spec({"policy": {"model_name": str(self.base_path(model.base)),
                                      "dtensor_cfg": {"lora_cfg": lora},
                                      "train_micro_batch_size": self.cfg.micro_batch_size,
                                      "optimizer": {"kwargs": {"weight_decay": 0.0, "eps": 1e-12,
                                                               "betas": [0.9, 0.95]}}},
                           "cluster": {"device": self.cfg.device}})

    def create_model(self, owner: str, body: dict[str, Any]) -> Future:
        from rlserve.tinker.wire import field_of

        sid = field_of(body, "session_id", str)
        seq = field_of(body, "model_seq_id", int)
        base = field_of(body, "base_model", str)
        lora = field_of(body, "lora_config", dict, required=False, default={"rank": 32})
        session = self._session(owner, sid)
        model_id = f"{sid}:train:{seq}"

        async def work(future: Future):
            rank = lora.get("rank")
            if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= 256:
                raise UserError("lora_config.rank", f"must be an integer in [1, 256], got {rank!r}")
            flags = {k: lora.get(k, True) for k in ("train_mlp", "train_attn", "train_unembed")}
            if not any(flags.values()):
                raise UserError("lora_config", "one of train_mlp, train_attn, train_unembed must be true")
            self.base_path(base)
            optimizer = body.get("optimizer_config") or {"type": "adamw"}
            if optimizer.get("type", "adamw") != "adamw":
                raise UserError("optimizer_config.type", f"{optimizer.get('type')!r}: this server trains with "
                                                         f"adamw only")
            if model_id in self.models:
                return {"model_id": model_id, "type": "create_model"}
            mine = [m for m in self.models.values() if m.owner == owner]
            if len(mine) >= self.cfg.max_models:
                future.queue_state = "paused_rate_limit"
                raise UserError("base_model", f"{owner} holds {len(mine)} models, the most a user may "
                                              f"(unload one, or finish its session)")
            model = Model(model_id, owner, sid, base, rank, bool(flags["train_mlp"]), bool(flags["train_attn"]),
                          bool(flags["train_unembed"]), body.get("user_metadata"))
            await self.trainer.configure(model.run_id, self._spec(model), self.base_path(base), None)
            self.models[model_id] = model
            session.models.append(model_id)
            return {"model_id": model_id, "type": "create_model"}

        return self.ordered(owner, f"create:{model_id}", Ordering(), 1, work)

    def info(self, owner: str, model_id: str) -> dict[str, Any]:
        model = self.model(owner, model_id)
        return {"type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": model.rank,
                "model_name": model.base, "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": "causal_lm", "model_name": model.base,
                               "tokenizer_id": str(self.base_path(model.base))}}

    async def unload(self, owner: str, model_id: str) -> dict[str, Any]:
        model = self.model(owner, model_id)
        self.models.pop(model_id, None)
        session = self.sessions.get(model.session_id)
        if session is not None and model_id in session.models:
            session.models.remove(model_id)
        await self.trainer.release(model.run_id)
        return {"model_id": model_id, "type": "unload_model"}

    # --- the primitives -----------------------------------------------------------------------

    def forward_backward(self, owner: str, req: FwdBwdRequest | UserError, model_id: str, seq_id: int) -> Future:
        model = self.model(owner, model_id)

        async def work(future: Future):
            if isinstance(req, UserError):
                raise req
            batch = DatumBatch(req.datums, req.loss, req.config)
            if req.loss == "stable_reinforce":
                self._fill_recorded(owner, req)
            result = await self.trainer.forward(model.run_id, batch, backward=not req.forward_only)
            if not req.forward_only:
                model.trained_tokens += batch.num_tokens
            from rlserve.tinker.wire import forward_backward_output

            return forward_backward_output(result.logprobs, {"loss:sum": result.metrics["loss:sum"]})

        return self.ordered(owner, model_id, model.ordering, seq_id, work)

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
        from rlserve.tinker.wire import field_of

        model_id = field_of(body, "model_id", str)
        seq_id = field_of(body, "seq_id", int)
        model = self.model(owner, model_id)
        params = body.get("adam_params") or body.get("optim_params") or body.get("optimizer_params")

        async def work(future: Future):
            step = _adam(params)
            result = await self.trainer.optim_step(model.run_id, step)
            model.version = result.version
            return {"type": "optim_step", "metrics": {k: v for k, v in result.metrics.items()}}

        return self.ordered(owner, model_id, model.ordering, seq_id, work)

    # --- checkpoints --------------------------------------------------------------------------

    def _folder(self, owner: str, model_id: str, kind: str, name: str) -> Path:
        return self.cfg.checkpoints_dir / owner / model_id.replace(":", "_") / kind / name

    def resolve_path(self, owner: str, path: str, field_name: str = "path") -> tuple[Path, dict[str, Any]]:
        """The folder and metadata of the caller's `tinker://` checkpoint (another user's: missing)."""
        m = re.fullmatch(r"tinker://([^/]+)/(weights|sampler_weights)/([^/]+)", path or "")
        if m is None:
            raise UserError(field_name, f"{path!r} is not a tinker:// checkpoint path "
                                        f"(tinker://MODEL/weights/NAME or .../sampler_weights/NAME)")
        folder = self._folder(owner, m.group(1), m.group(2), m.group(3))
        meta = folder / "checkpoint.json"
        if not meta.is_file():
            raise UserError(field_name, f"no checkpoint {path!r}")
        info = json.loads(meta.read_text())
        if info.get("expires_at") is not None and info["expires_at"] < time.time():
            shutil.rmtree(folder, ignore_errors=True)
            raise UserError(field_name, f"no checkpoint {path!r} (it expired)")
        return folder, info

    def save(self, owner: str, body: dict[str, Any], for_sampler: bool) -> Future:
        from rlserve.tinker.wire import field_of

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
            if for_sampler:
                await self.trainer.save(model.run_id, folder / "state", folder / "adapter")
                shutil.rmtree(folder / "state", ignore_errors=True)
            else:
                await self.trainer.save(model.run_id, folder / "state", folder / "adapter")
            meta = {"model_id": model_id, "kind": kind, "name": label, "base": model.base, "rank": model.rank,
                    "version": model.version, "created": time.time(), "user_metadata": body.get("user_metadata"),
                    "expires_at": None if ttl is None else time.time() + ttl, "ephemeral": name is None,
                    "lora": {"train_mlp": model.train_mlp, "train_attn": model.train_attn,
                             "train_unembed": model.train_unembed}}
            (folder / "checkpoint.json").write_text(json.dumps(meta))
            path = f"tinker://{model_id}/{kind}/{label}"
            if for_sampler and name is None:
                sid = self._new_sampler(owner, model.base, folder / "adapter", path, model.session_id, sampler_seq)
                return {"type": "save_weights_for_sampler", "sampling_session_id": sid}
            return {"type": "save_weights_for_sampler" if for_sampler else "save_weights", "path": path}

        return self.ordered(owner, model_id, model.ordering, seq_id, work)

    def load(self, owner: str, body: dict[str, Any]) -> Future:
        """`load_state` onto an existing model (model_id, seq_id), or a new model from a checkpoint
        (`create_training_client_from_state`: session_id, model_seq_id)."""
        from rlserve.tinker.wire import field_of

        path = field_of(body, "path", str)
        optimizer = bool(body.get("optimizer"))
        if body.get("model_id") is not None:
            model = self.model(owner, field_of(body, "model_id", str))
            key, ordering, seq_id = model.model_id, model.ordering, field_of(body, "seq_id", int)
            new_session = None
        else:
            new_session = self._session(owner, field_of(body, "session_id", str))
            seq = field_of(body, "model_seq_id", int)
            model, key, ordering, seq_id = None, f"{new_session.session_id}:train:{seq}", Ordering(), 0

        async def work(future: Future):
            nonlocal model
            folder, meta = self.resolve_path(owner, path)
            if meta["kind"] != "weights":
                raise UserError("path", f"{path!r} holds sampler weights; load_state takes a save_state path")
            if model is None:
                if key in self.models:
                    return {"type": "load_weights", "path": path, "model_id": key}
                lora = meta.get("lora", {})
                model = Model(key, owner, new_session.session_id, body.get("base_model") or meta["base"],
                              meta["rank"], lora.get("train_mlp", True), lora.get("train_attn", True),
                              lora.get("train_unembed", True), body.get("user_metadata"))
            elif (model.base, model.rank) != (meta["base"], meta["rank"]):
                raise UserError("path", f"{path!r} is a rank-{meta['rank']} adapter of {meta['base']}; this model "
                                        f"is rank {model.rank} on {model.base}")
            base = self.base_path(model.base)
            if optimizer:
                await self.trainer.configure(model.run_id, self._spec(model), base, None)
                model.version = await self.trainer.load(model.run_id, folder / "state")
            else:
                await self.trainer.configure(model.run_id, self._spec(model), base, folder / "adapter")
                model.version = 0
            if key not in self.models:
                self.models[key] = model
                new_session.models.append(key)
            return {"type": "load_weights", "path": path, "model_id": key}

        return self.ordered(owner, key, ordering, seq_id, work)

    def checkpoints(self, owner: str, model_id: str) -> list[dict[str, Any]]:
        root = self.cfg.checkpoints_dir / owner / model_id.replace(":", "_")
        if not root.is_dir() and model_id not in {m.model_id for m in self.models.values() if m.owner == owner}:
            raise UserError("training_run_id", f"no training run {model_id!r}")
        out = []
        for meta_file in sorted(root.glob("*/*/checkpoint.json")):
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

    def training_runs(self, owner: str) -> list[dict[str, Any]]:
        ids = {m.model_id for m in self.models.values() if m.owner == owner}
        root = self.cfg.checkpoints_dir / owner
        if root.is_dir():
            ids |= {json.loads(p.read_text())["model_id"] for p in root.glob("*/*/*/checkpoint.json")}
        return [self.training_run(owner, i) for i in sorted(ids)]

    def training_run(self, owner: str, model_id: str) -> dict[str, Any]:
        ckpts = self.checkpoints(owner, model_id)
        model = self.models.get(model_id) if self.models.get(model_id, None) and \
            self.models[model_id].owner == owner else None
        meta = next((json.loads(p.read_text()) for p in (self.cfg.checkpoints_dir / owner / model_id.replace(
            ":", "_")).glob("*/*/checkpoint.json")), {})
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

    def _new_sampler(self, owner: str, base: str, adapter: Path | None, model_path: str | None, session_id: str,
                     seq: int | None) -> str:
        sid = f"{session_id}:sample:{seq if seq is not None else uuid.uuid4().hex[:8]}"
        self.samplers[sid] = SamplingSession(sid, owner, base, adapter, model_path)
        return sid

    def create_sampler(self, owner: str, body: dict[str, Any]) -> str:
        from rlserve.tinker.wire import field_of

        session = self._session(owner, field_of(body, "session_id", str))
        seq = field_of(body, "sampling_session_seq_id", int)
        model_path = field_of(body, "model_path", str, required=False)
        if model_path is not None:
            folder, meta = self.resolve_path(owner, model_path, "model_path")
            return self._new_sampler(owner, meta["base"], folder / "adapter", model_path, session.session_id, seq)
        base = field_of(body, "base_model", str)
        self.base_path(base)
        return self._new_sampler(owner, base, None, None, session.session_id, seq)

    def sampler_info(self, owner: str, sid: str) -> dict[str, Any]:
        s = self._sampler(owner, sid)
        return {"sampler_id": sid, "base_model": s.base, "model_path": s.model_path}

    def _sampler(self, owner: str, sid: str) -> SamplingSession:
        s = self.samplers.get(sid)
        if s is None or s.owner != owner:
            raise UserError("sampling_session_id", f"no sampler {sid!r}")
        return s

    def sample(self, owner: str, body: dict[str, Any]) -> tuple[Future, list[str]]:
        from rlserve.tinker.wire import field_of, prompt_tokens, sample_response

        sid = field_of(body, "sampling_session_id", str)
        seq_id = field_of(body, "seq_id", int)
        s = self._sampler(owner, sid)
        n = field_of(body, "num_samples", int, required=False, default=1)
        ids = [f"{sid}:{seq_id}:{k}" for k in range(max(n, 0))]

        async def work(future: Future):
            if not 1 <= n <= self.cfg.max_samples:
                raise UserError("num_samples", f"must be in [1, {self.cfg.max_samples}], got {n}")
            prompt = prompt_tokens(body.get("prompt"), self.vocab_size(s.base), self.cfg.max_datum_tokens)
            sampling = _sampling(body.get("sampling_params"), self.vocab_size(s.base))
            topk = field_of(body, "topk_prompt_logprobs", int, required=False, default=0)
            if not 0 <= topk <= 64:
                raise UserError("topk_prompt_logprobs", f"must be in [0, 64], got {topk}")
            for unsupported in ("target_prompt_logprobs", "prompt_logprobs_last_n"):
                if body.get(unsupported):
                    raise UserError(unsupported, "is not served by this server")
            if body.get("topk_sample_logprobs") or body.get("prompt_alt_tokens_k"):
                raise UserError("topk_sample_logprobs", "top-k sample logprobs are not served by this server")
            samples = await self.sampler.sample(s.adapter, prompt, n, sampling)
            prompt_lps = topk_rows = None
            if body.get("prompt_logprobs") or topk:
                prompt_lps, topk_rows = await self.sampler.prompt_logprobs(s.adapter, prompt, topk)
            if body.get("record_stability_info"):
                for sample_id, sample in zip(ids, samples):
                    self.recorded[sample_id] = Recorded(owner, list(sample.token_ids), list(sample.logprobs))
            return sample_response(samples, prompt_lps if body.get("prompt_logprobs") else None, topk_rows)

        return self.ordered(owner, sid, s.ordering, seq_id, work), ids


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat()


def _adam(params: Any) -> AdamStep:
    if not isinstance(params, dict):
        raise UserError("adam_params", "is required")
    if params.get("type", "adam") not in ("adam", "adamw"):
        raise UserError("optim_params.type", f"{params.get('type')!r}: this server trains with AdamW only")
    known = {"learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm", "type"}
    extra = sorted(set(params) - known)
    if extra:
        raise UserError(f"adam_params.{extra[0]}", "is not an AdamParams field")
    values = {k: params[k] for k in known - {"type"} if k in params}
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise UserError(f"adam_params.{k}", f"must be a finite number, got {v!r}")
    step = AdamStep(**{k: float(v) for k, v in values.items()}) if "learning_rate" in values else \
        AdamStep(learning_rate=1e-4, **{k: float(v) for k, v in values.items()})
    for name, ok in (("learning_rate", step.learning_rate >= 0), ("beta1", 0 <= step.beta1 < 1),
                     ("beta2", 0 <= step.beta2 < 1), ("eps", step.eps >= 0), ("weight_decay", step.weight_decay >= 0),
                     ("grad_clip_norm", step.grad_clip_norm >= 0)):
        if not ok:
            raise UserError(f"adam_params.{name}", f"{getattr(step, name)} is out of range")
    return step


def _sampling(params: Any, vocab_size: int) -> SamplingSpec:
    if not isinstance(params, dict):
        raise UserError("sampling_params", "is required")
    max_tokens = params.get("max_tokens")
    if max_tokens is None:
        max_tokens = 16
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= 8192:
        raise UserError("sampling_params.max_tokens", f"must be an integer in [1, 8192], got {max_tokens!r}")
    temperature = params.get("temperature", 1.0)
    top_p = params.get("top_p", 1.0)
    top_k = params.get("top_k", -1)
    if not isinstance(temperature, (int, float)) or not 0 <= temperature <= 100:
        raise UserError("sampling_params.temperature", f"must be in [0, 100], got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise UserError("sampling_params.top_p", f"must be in (0, 1], got {top_p!r}")
    if not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
        raise UserError("sampling_params.top_k", f"must be -1 or >= 1, got {top_k!r}")
    stop = params.get("stop")
    strings: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()
    if isinstance(stop, str):
        strings = (stop,)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        strings = tuple(stop)
    elif isinstance(stop, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in stop):
        if any(not 0 <= x < vocab_size for x in stop):
            raise UserError("sampling_params.stop", f"token ids must be in [0, {vocab_size})")
        token_ids = tuple(stop)
    elif stop is not None:
        raise UserError("sampling_params.stop", "must be a string, a list of strings or a list of token ids")
    seed = params.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise UserError("sampling_params.seed", f"must be an integer, got {seed!r}")
    return SamplingSpec(temperature=float(temperature), top_p=float(top_p), top_k=None if top_k == -1 else top_k,
                        max_new_tokens=max_tokens, stop_strings=strings, stop_token_ids=token_ids, seed=seed)
