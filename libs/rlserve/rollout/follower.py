"""A rollout replica's side of weight sync: direct transfers from the learner, catch-up from the store.

The replica joins the fleet (`rlserve.weights.fleet`) and long-polls its
mailbox. Two things arrive there:

- The steps of a direct transfer (vLLM's weight-transfer API, driven by the
  learner): init, start, update, finish, abort. Each is checked and handed to
  the engine, which pauses, loads and resumes as the engine sees fit.
- Announcements of new publications in the weight store
  (`rlserve.weights.store`). A replica that already holds that version (it
  came directly) ignores it; any other loads it from the store: a replica that
  started late, restarted, or lost its link during a transfer. That load
  runs in a task beside the polling: it waits for a direct round in progress,
  and the round's next steps come through the same mailbox.

A round holds the engine's update lock from its start to its finish. One
whose sender went quiet (a learner worker killed mid-round) is aborted after
the transfer time-out, on a clock of its own, and one that a new round or
link finds still open is aborted at once: no load waits on it for good.

Every update is validated against the served model's checkpoint layout before
the engine sees it (a failed reload can leave vLLM broken); the old weights
keep serving on any error. A replica also loads the newest publication
before it serves at all.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from rlserve.logs import event
from rlserve.rollout.interfaces import RolloutEngine
from rlserve.rpc import RpcError, failed_precondition, invalid_argument, status_of
from rlserve.weights import adapter
from rlserve.weights.fleet import PUBLISHED, Command, Member
from rlserve.weights.specs import TensorSpec, check_update, checkpoint_specs
from rlserve.weights.store import Publication, fetch_tensors

log = logging.getLogger("rlserve.rollout")
# How long one long poll of the mailbox waits (a member polls again at once; see fleet.MEMBER_LEASE_S). A command
# arrives the moment it is sent whatever this is: it only sets how often an idle replica calls the fleet.
POLL_S = 60.0
# How often an open direct round is checked for a sender gone quiet (`_expire_rounds`).
EXPIRY_CHECK_S = 5.0
# Where adapters are written for the engine to read (memory-backed where there is one).
_SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
TOKEN_BYTES = 256 * 1024


@dataclass(frozen=True)
class Applied:
    version: int
    num_tensors: int
    num_bytes: int
    fetch_seconds: float
    apply_seconds: float


class WeightFollower:
    def __init__(self, store: ray.actor.ActorHandle, fleet: ray.actor.ActorHandle, engine: RolloutEngine,
                 specs: dict[str, TensorSpec], replica_id: str, transfer_timeout_s: float,
                 confine_base: Callable[[str], Path]):
        """`confine_base` maps an adapter's base model folder to a path the rollout may read (raises
        RpcError PERMISSION_DENIED outside the cluster's model directories and runs directory)."""
        self.store, self.fleet = store, fleet
        self.engine, self.specs, self.replica_id = engine, specs, replica_id
        self.confine_base = confine_base
        self.transfer_timeout_s = transfer_timeout_s
        self.publish_id = 0
        self.run_id = ""
        self._direct: dict[str, Any] = {}  # the direct round in progress: its run, the tensors received
        self._direct_version: int | None = None  # the version the last direct transfer brought
        self._tasks: list[asyncio.Task] = []  # the mailbox's poller and the direct rounds' clock
        self._background: set[asyncio.Task] = set()  # catch-ups from the store
        self._catch_up_waiting = False
        self._in_step, self._last_step = False, time.monotonic()  # the direct round's latest step
        self._loading = asyncio.Lock()

    @property
    def version(self) -> int:
        return self.engine.version

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the newest publication (an unusable one is skipped with a warning), then join the fleet."""
        await self._join()
        try:
            await self._catch_up()
        except RpcError as err:  # serve the deployed weights until the next publication
            self.publish_id = (await self.store.head.remote())[0]
            event(log, "rollout.publication_unusable", logging.WARNING, replica=self.replica_id, error=err.message)
        self._tasks = [asyncio.create_task(self._listen()), asyncio.create_task(self._expire_rounds())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.fleet.leave.remote(self.replica_id)

    async def _join(self) -> None:
        # Big enough to live in the shared object store (small objects are copied inline, and
        # would not be lost with this process): the fleet's sign that this replica is alive.
        self._token = ray.put(bytes(TOKEN_BYTES))
        await self.fleet.join.remote(Member(self.replica_id, self.engine.transfer_backend,
                                            self.engine.num_transfer_workers, (self._token,)))

    async def _listen(self) -> None:
        """Poll the mailbox for as long as the replica lives. No failure ends it: a replica that stopped polling
        is dropped from the fleet and would never hear of a new version again."""
        while True:
            try:
                await self._poll()
            except Exception as err:  # noqa: BLE001 - logged; the next poll starts over
                event(log, "rollout.fleet_poll_failed", logging.WARNING, replica=self.replica_id,
                      error=status_of(err).message)
                await asyncio.sleep(1.0)

    async def _poll(self) -> None:
        try:
            cmd = await self.fleet.next_command.remote(self.replica_id, POLL_S)
        except ray.exceptions.RayTaskError as err:
            if not isinstance(err.cause, KeyError):
                raise
            await self._join()  # dropped (or a new fleet): join again, then catch up
            self._catch_up_soon()
            return
        except ray.exceptions.RayActorError:  # the fleet restarts; poll again shortly
            await asyncio.sleep(1.0)
            return
        if cmd is None:
            return
        if cmd.kind == PUBLISHED:
            # A load from the store waits for a direct round in progress, whose next steps come through
            # this mailbox: it runs beside the polling, never in its way.
            self._catch_up_soon()
            return
        error = await self._handle(cmd)
        await self.fleet.reply.remote(self.replica_id, cmd.seq, error)

    async def _handle(self, cmd: Command) -> str | None:
        self._in_step = True
        try:
            await self._transfer_step(cmd.kind, cmd.payload)
            return None
        except Exception as err:  # noqa: BLE001 - reported to the sender; the replica keeps serving
            message = status_of(err).message
            event(log, "rollout.weight_command_failed", logging.WARNING, replica=self.replica_id, command=cmd.kind,
                  error=message)
            return message
        finally:
            self._in_step, self._last_step = False, time.monotonic()

    # --- direct transfer ------------------------------------------------------------------------

    async def _transfer_step(self, kind: str, payload: dict) -> None:
        engine = self.engine
        start = payload.get("start")
        if self._direct and (start is not None or kind == "init"):
            # A new link or round while one is open: its sender gave that round up and moved on.
            event(log, "rollout.weight_transfer_superseded", logging.WARNING, replica=self.replica_id,
                  run=self._direct.get("run_id") or None)
            await self._abort()
        if start is not None:  # a round's start travels with its first step
            await engine.start_weight_update(start["in_flight"])
            self._direct = {"run_id": start["run_id"]}
        if kind == "init":
            await engine.init_weight_transfer(payload["init_info"])
        elif kind == "update":
            info = payload["update_info"]
            got = {n: TensorSpec(tuple(s), getattr(torch, d)) for n, d, s in zip(
                info["names"], info["dtype_names"], info["shapes"])}
            # A bucketed round (`handoff`) sends its tensors in parts: the whole is checked at finish.
            problems = check_update(self.specs, got, complete=not info.get("bucket"))
            if problems:
                await self._abort()
                raise invalid_argument("weights", "; ".join(problems[:5]))
            self._direct.setdefault("received", {}).update(got)
            await engine.update_weights(info)
            if payload.get("finish") is not None:  # a round's finish may travel with its last step
                await self._finish(payload["finish"])
        elif kind == "finish":
            await self._finish(payload)
        elif kind == "abort":
            await self._abort()
        else:
            raise invalid_argument("command", f"unknown weight command {kind!r}")

    async def _finish(self, round_: dict) -> None:
        t0 = time.perf_counter()
        missing = check_update(self.specs, self._direct.get("received", {}))
        if missing:
            await self._abort()
            raise invalid_argument("weights", "; ".join(missing[:5]))
        self._direct = {}
        await self.engine.finish_weight_update(round_["version"], round_["in_flight"])
        self.run_id, self._direct_version = round_["run_id"], round_["version"]
        event(log, "rollout.weights_applied", replica=self.replica_id, run=self.run_id or None,
              version=round_["version"], source="direct", apply_s=time.perf_counter() - t0)

    async def _abort(self) -> None:
        self._direct = {}
        await self.engine.abort_weight_update()

    async def _expire_rounds(self) -> None:
        """A direct round whose sender sent no step for the time-out is aborted (its buffers freed, the engine's
        update lock released). Checked on a clock of its own: nothing the mailbox brings can hold it up."""
        while True:
            await asyncio.sleep(EXPIRY_CHECK_S)
            quiet_s = time.monotonic() - self._last_step
            if self._direct and not self._in_step and quiet_s > self.transfer_timeout_s:
                event(log, "rollout.weight_transfer_expired", logging.WARNING, replica=self.replica_id,
                      run=self._direct.get("run_id") or None)
                try:
                    await self._abort()
                except Exception as err:  # noqa: BLE001 - logged; the replica keeps serving its weights
                    event(log, "rollout.weight_abort_failed", logging.WARNING, replica=self.replica_id,
                          error=status_of(err).message)

    # --- from the store ---------------------------------------------------------------------------

    async def _catch_up(self) -> None:
        """Load the newest publication unless it is what this replica serves already."""
        async with self._loading:
            await self._catch_up_locked()

    async def _catch_up_locked(self) -> None:
        pub = await self.store.latest.remote()
        if pub is None or pub.publish_id <= self.publish_id:
            return
        if (pub.run_id, pub.version) == (self.run_id, self.version):
            self.publish_id = pub.publish_id  # it came directly
            return
        await self._apply(pub, pub.in_flight)

    def _catch_up_soon(self) -> None:
        """Catch up in a task of its own. One waits at a time: it reads the newest publication once it may
        load, which covers every announcement made while it waited."""
        if not self._catch_up_waiting:
            self._catch_up_waiting = True
            self._background.add(task := asyncio.create_task(self._background_catch_up()))
            task.add_done_callback(self._background.discard)

    async def _background_catch_up(self) -> None:
        try:
            async with self._loading:
                self._catch_up_waiting = False
                await self._catch_up_locked()
        except Exception as err:  # noqa: BLE001 - the replica keeps its weights; a request's sync tries again
            event(log, "rollout.weight_command_failed", logging.WARNING, replica=self.replica_id,
                  command=PUBLISHED, error=status_of(err).message)

    async def sync(self, min_version: int) -> None:
        """Before a request: catch up from the store if this replica is behind it (a newer publication
        than it holds, whatever the version numbers: a new run starts again at version 0) or serves an
        older version than the request needs. The fleet's announcement of each publication does the
        same, but it may arrive after the request.

        The load is shielded: a caller that gives up must not stop it between pause and resume. A
        publication that cannot be loaded (its buckets died with the learner session that put them)
        leaves this replica behind: the caller sees that and answers ABORTED, since only a new
        publication (the run's recovery) can help.
        """
        head = await self.store.head.remote()
        if (head is not None and head[0] > self.publish_id) or self.version < min_version:
            try:
                await asyncio.shield(self._catch_up())
            except RpcError as err:
                event(log, "rollout.publication_unusable", logging.WARNING, replica=self.replica_id,
                      error=err.message)

    async def update_to(self, version: int, in_flight: bool) -> Applied | None:
        """Load `version`, which must be the newest publication; None when it is already loaded."""
        return await asyncio.shield(self._update_to(version, in_flight))

    async def _update_to(self, version: int, in_flight: bool) -> Applied | None:
        async with self._loading:
            if self._direct_version == version == self.version:
                return None  # it came directly; after a same-device handoff the store's copy follows later
            pub = await self.store.latest.remote()
            if pub is None or pub.version != version:
                have = "nothing" if pub is None else f"version {pub.version}"
                raise failed_precondition(f"version {version} is not the newest publication ({have})")
            if pub.publish_id == self.publish_id:
                return None
            if (pub.run_id, pub.version) == (self.run_id, self.version):
                self.publish_id = pub.publish_id  # it came directly
                return None
            return await self._apply(pub, in_flight)

    async def publish_folder(self, path: Path, version: int, force: bool, in_flight: bool) -> None:
        """Publish a folder of HF-named safetensors, or a PEFT adapter for the served base model (checked
        first), so that every replica moves to it."""
        if not any(path.glob("*.safetensors")):
            raise invalid_argument("safetensors_path", f"{path}: no *.safetensors files")
        if version <= self.version and not force:
            raise invalid_argument("version", f"{version} is not newer than the served {self.version} "
                                              f"(set force to load it anyway)")
        config = adapter.read_adapter(path)[1] if adapter.is_adapter_folder(path) else None
        problems = self._check(checkpoint_specs(path), config)
        if problems:
            raise invalid_argument("safetensors_path", "; ".join(problems[:5]))
        num_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        publish_id = await self.store.publish.remote(self.run_id, version, [], len(self.specs), num_bytes,
                                                     in_flight, str(path), config)
        await self.fleet.announce.remote(publish_id, version)

    def _check(self, got: dict[str, TensorSpec], adapter_config: dict | None) -> list[str]:
        """Problems of an update for the served model: its weights, or an adapter on a base of its layout."""
        if adapter_config is None:
            return check_update(self.specs, got)
        base = self._base(adapter_config)
        if base != Path(self.engine.info().model).resolve():
            problems = check_update(self.specs, checkpoint_specs(base))
            if problems:
                return [f"the adapter's base model {base}: {p}" for p in problems]
        return adapter.check_adapter(self.specs, got, adapter_config)

    def check_run_adapter(self, got: dict[str, TensorSpec], adapter_config: dict) -> list[str]:
        """Problems of a run's adapter served beside others (`rlserve.rollout.adapters`): it must adapt the
        deployed model itself."""
        base, deployed = self._base(adapter_config), Path(self.engine.info().model).resolve()
        if base != deployed:
            return [f"the adapter's base model {base} is not the deployed model {deployed} (a run on its own "
                    f"base does not share the rollout)"]
        return adapter.check_adapter(self.specs, got, adapter_config)

    def _base(self, adapter_config: dict) -> Path:
        """The model folder an adapter applies to (the deployed model when its config names none)."""
        named = adapter_config.get("base_model_name_or_path")
        return self.confine_base(named).resolve() if named else Path(self.engine.info().model).resolve()

    async def _apply(self, pub: Publication, in_flight: bool) -> Applied:
        """Fetch, validate, then load one publication (the caller holds `_loading`)."""
        t0 = time.perf_counter()
        if pub.safetensors_path:
            got = checkpoint_specs(pub.safetensors_path)
            tensors = None
        else:
            tensors = await fetch_tensors(pub)
            got = {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in tensors.items()}
        problems = self._check(got, pub.adapter_config)
        if problems:
            raise invalid_argument("weights", "; ".join(problems[:5]))
        t1 = time.perf_counter()
        try:
            await self._load(pub, tensors, in_flight)
        except ValueError as err:
            raise failed_precondition(str(err)) from None
        t2 = time.perf_counter()
        self.publish_id, self.run_id, self._direct_version = pub.publish_id, pub.run_id, None
        event(log, "rollout.weights_applied", replica=self.replica_id, run=pub.run_id or None,
              version=pub.version, source="store", tensors=len(got), fetch_s=t1 - t0, apply_s=t2 - t1)
        return Applied(pub.version, len(got), pub.num_bytes, t1 - t0, t2 - t1)

    async def _load(self, pub: Publication, tensors: dict[str, torch.Tensor] | None, in_flight: bool) -> None:
        if pub.adapter_config is not None:
            # The engine reads adapters from a folder it then owns (memory-backed where there is /dev/shm).
            folder = Path(tempfile.mkdtemp(prefix="rlserve-adapter-", dir=_SHM))
            if tensors is None:
                tensors = adapter.read_adapter(Path(pub.safetensors_path))[0]
            await asyncio.to_thread(adapter.write_adapter, folder, tensors, pub.adapter_config)
            await self.engine.load_adapter(folder, self._base(pub.adapter_config), pub.version, in_flight)
        elif tensors is None:
            await self.engine.load_weights_from_path(Path(pub.safetensors_path), pub.version, in_flight)
        else:
            await self.engine.load_weights(list(tensors.items()), pub.version, in_flight)

