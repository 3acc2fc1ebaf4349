"""Load and abuse against a training cluster: do well-behaved callers and the run itself hold up?

One local cluster (the embedded default's services, its own ports) trains a run of the demo task.
Its steps are timed in four phases of `--phase-s` seconds each, side by side in one invocation:
  - quiet:  only the run;
  - load:   `--callers` concurrent well-behaved callers on loopback (`--callers-per-user` to a user,
            each user with a run of its own waiting in the queue), each looping over GetRun,
            ListRuns, a short WatchRun (its first events), and every 20th caller a SubmitRun of a
            tiny run that it cancels at once;
  - abuse:  the same callers, plus one abusive caller (its own token, its own process) doing what once stalled
            everyone: 80 idle WatchRun streams from sequence 10**12, 240 KB specs of 120,000 list
            items, and 60 MB specs, 4 at a time (with `--abuse-apart`, then one phase for each of the three
            alone);
  - quiet again: only the run. The baseline is both quiet phases' steps together, so a drift of the run's
            own speed over time (the machine's, or the run's) shows as the two quiet phases disagreeing
            rather than as an effect of the callers.
Reported per phase: p50, p99 and max latency of the well-behaved calls (and the p99 of each kind of call), their
errors by code, how long the callers' own event loop stalled (over 50 ms) and the p99 of the calls made during
none of its stalls, the abuser's refusals, the run's median step time (and its generation and training parts,
and the learner's own compute within training) against the quiet phases', and the cores each part kept busy
(gateway, coordinator, reward, training, Ray's own processes, and this harness, which shares the machine, or
has cores of its own with `--harness-cores`). With `--chaos-s`, a chaos soak follows: every 60-120 s one of
rollout, reward, reference, the learner worker, the coordinator or the gateway is killed at random; then the run
goes on to its last step, and it must end with a balanced ledger, no run may be left unfinished, and the
cluster's resident memory is reported before and after.
Prints a table and writes bench-results/soak.json.

    .venv/bin/python scripts/bench/soak.py [--callers 500] [--phase-s 120] [--chaos-s 1800] [--steps N]
                                           [--control-cores 0-3 [--harness-cores 12-15]] [--abuse-apart]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.common import record, table  # noqa: E402

PORT_BASE = 6980
TINY = "name: soak-tiny\ngrpo: {max_num_steps: 1, num_prompts_per_step: 2, num_generations_per_prompt: 2}\n"
STALL_S = 0.05  # a lag of the callers' event loop longer than this is a stall of this harness
KILLABLE = ("rollout", "reward", "reference", "LearnerWorker", "coordinator", "gateway")


CONTROL_SERVICES = ("coordinator", "reward")
TRAINING_SERVICES = ("rollout", "reference", "learner")


def parse_cores(text: str) -> list[int]:
    """`0-3,8` -> [0, 1, 2, 3, 8]."""
    cores: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        cores += range(int(first), int(last or first) + 1)
    return cores


def soak_cluster(root: Path, read_cache_ms: int, control_cores: list[int] | None, harness_cores: list[int]):
    import yaml

    from rlserve.cluster.config import load_cluster_file
    from rlserve.cluster.lifecycle import Cluster

    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "libs/rlserve/cluster/default_cluster.yaml")
                          .read_text())
    data.update({"name": "soak", "ray_port": PORT_BASE, "grpc_port": PORT_BASE + 10, "runs_dir": str(root / "runs"),
                 "read_cache_ms": read_cache_ms})
    if control_cores:  # the layout an operator would write: the cluster file's keys, read as each replica starts
        training = sorted(set(range(os.cpu_count() or 1)) - set(control_cores) - set(harness_cores))
        data["gateway_cpu_cores"] = control_cores
        for name in CONTROL_SERVICES + TRAINING_SERVICES:
            data["services"][name]["cpu_cores"] = control_cores if name in CONTROL_SERVICES else training
    path = root / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg, runs = load_cluster_file(path)
    return Cluster(cfg, runs)


def training_spec(steps: int) -> str:
    """The demo run for `steps` steps, training every group: by default a group whose samples all got the same
    reward is skipped, so the demo's steps train less and less as it learns and a later phase's steps would be
    faster for that alone (a first soak on 16 cores saw training's part of a step halve over four phases)."""
    import yaml

    spec = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples/grpo_addition.yaml").read_text())
    spec["grpo"].update({"max_num_steps": steps, "skip_zero_advantage_groups": False})
    return yaml.safe_dump(spec)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Callers:
    """Well-behaved callers, `per_user` to a user: every call's latency and error, per phase. Each user
    watches its own queued run (a user sees only its own runs) beside the training run's owner."""

    def __init__(self, endpoint: str, users: list[tuple[str, str]], n: int):
        self.endpoint, self.users, self.n = endpoint, users, n  # users: (token, run id)
        self.latencies: list[tuple[str, float]] = []  # (the call, seconds)
        self.spans: list[tuple[float, float]] = []  # each call's (start, end), perf_counter seconds
        self.errors: list[str] = []
        self.loop_lags: list[float] = []  # seconds (`watch_loop`)
        self.stalls: list[tuple[float, float]] = []  # (start, end) of each lag over STALL_S

    async def caller(self, i: int, stop: float) -> None:
        import grpc

        from rlserve.v1 import coordinator_pb2 as pb
        from rlserve.v1 import coordinator_pb2_grpc

        token, run_id = self.users[i % len(self.users)]
        md = (("authorization", f"Bearer {token}"),)
        async with grpc.aio.insecure_channel(self.endpoint) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                kind = random.random()
                try:
                    if kind < 0.45:
                        call = "GetRun"
                        await stub.GetRun(pb.GetRunRequest(run_id=run_id), metadata=md, timeout=30)
                    elif kind < 0.8:
                        call = "ListRuns"
                        await stub.ListRuns(pb.ListRunsRequest(), metadata=md, timeout=30)
                    elif kind < 0.98 or i % 20:
                        call = "WatchRun"
                        stream = stub.WatchRun(pb.WatchRunRequest(run_id=run_id), metadata=md, timeout=30)
                        await stream.read()
                        stream.cancel()
                    else:
                        call = "SubmitRun+CancelRun"
                        run = (await stub.SubmitRun(pb.SubmitRunRequest(spec_yaml=TINY), metadata=md, timeout=30)).run
                        await stub.CancelRun(pb.CancelRunRequest(run_id=run.run_id), metadata=md, timeout=30)
                    t1 = time.perf_counter()
                    self.latencies.append((call, t1 - t0))
                    self.spans.append((t0, t1))
                except grpc.aio.AioRpcError as err:
                    self.errors.append(err.code().name)
                await asyncio.sleep(random.uniform(0.2, 1.0))

    async def run(self, seconds: float) -> None:
        stop = time.monotonic() + seconds
        await asyncio.gather(*(self.caller(i, stop) for i in range(self.n)), self.watch_loop(stop))

    async def watch_loop(self, stop: float, tick: float = 0.01) -> None:
        """How late this process's event loop wakes: every call's latency includes it, so a phase's p99 is the
        service's only where the loop's lag is small against it."""
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            await asyncio.sleep(tick)
            late = time.perf_counter() - t0 - tick
            self.loop_lags.append(late)
            if late > STALL_S:
                self.stalls.append((t0 + tick, t0 + tick + late))

    def latencies_outside_stalls(self) -> list[float]:
        """The calls during none of this loop's stalls: what the service's latency is, apart from this harness's
        (on 2 cores the callers' own process stalls for up to half a second now and then)."""
        starts = [start for start, _ in self.stalls]
        out = []
        for t0, t1 in self.spans:
            i = bisect.bisect_left(starts, t1)  # stalls that began before the call ended
            if i == 0 or self.stalls[i - 1][1] <= t0:  # the stalls follow one another: their ends are in order
                out.append(t1 - t0)
        return out


ABUSES = ("idle watches", "slow specs", "huge specs")


async def abuse(endpoint: str, token: str, run_id: str, seconds: float, kinds: tuple[str, ...] = ABUSES
                ) -> dict[str, int]:
    """What once stalled every caller, from one token (`kinds`: which of `ABUSES`); counts how each attempt
    was answered."""
    import grpc

    from rlserve.v1 import coordinator_pb2 as pb
    from rlserve.v1 import coordinator_pb2_grpc

    md = (("authorization", f"Bearer {token}"),)
    answers: dict[str, int] = {}
    stop = time.monotonic() + seconds
    specs = ["a: [" + ",".join(["1"] * 120_000) + "]"] * 4 * ("slow specs" in kinds) + \
            ["a: " + "x" * (60 * 2**20)] * 4 * ("huge specs" in kinds)
    async with grpc.aio.insecure_channel(endpoint, options=[("grpc.max_send_message_length", 2**27)]) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        streams = [stub.WatchRun(pb.WatchRunRequest(run_id=run_id, from_sequence=10**12), metadata=md)
                   for _ in range(80 * ("idle watches" in kinds))]

        async def spec(text: str) -> None:
            try:
                await stub.SubmitRun(pb.SubmitRunRequest(spec_yaml=text), metadata=md, timeout=60)
                answers["accepted"] = answers.get("accepted", 0) + 1
            except grpc.aio.AioRpcError as err:
                answers[err.code().name] = answers.get(err.code().name, 0) + 1

        while time.monotonic() < stop:
            await (asyncio.gather(*(spec(text) for text in specs)) if specs else asyncio.sleep(stop - time.monotonic()))
        for s in streams:
            key = f"watch:{(await s.code()).name}" if s.done() else "watch:open"
            answers[key] = answers.get(key, 0) + 1
            s.cancel()
    return answers


def abuse_in_own_process(endpoint: str, token: str, run_id: str, seconds: float,
                         kinds: tuple[str, ...]) -> dict[str, int]:
    """`abuse` in a process of its own: building and sending 60 MB specs must not stall the well-behaved
    callers' event loop, or their latencies would measure this harness rather than the service."""
    return asyncio.run(abuse(endpoint, token, run_id, seconds, kinds))


# A step's seconds in all, in generation and in training as the coordinator waits for them, and the learner's
# own compute within training: training slowed while its compute did not is the calls' way there and back.
STEP_PARTS = {"step_s": "timing/step_s", "generate_s": "timing/generate_s", "train_s": "timing/train_s",
              "learner_s": "perf/learner_step_seconds"}


def step_times(runs_dir: Path, run_id: str, since: float, until: float) -> list[dict[str, float]]:
    """The run's steps between two times: each one's seconds of each of `STEP_PARTS`."""
    import json

    rows = [json.loads(line) for line in (runs_dir / run_id / "events.jsonl").read_text().splitlines()]
    return [{part: r["metrics"][key] for part, key in STEP_PARTS.items()} for r in rows
            if r["kind"] == "step" and since <= r["time"] <= until and "timing/step_s" in r["metrics"]]


def medians(steps: list[dict[str, float]]) -> dict[str, float]:
    return {part: statistics.median(s[part] for s in steps) if steps else float("nan") for part in STEP_PARTS}


def cluster_processes() -> tuple[int, int, int]:
    """(processes, resident bytes, zombies) of the cluster's processes. A process the chaos killed may be
    a zombie until its parent reaps it, or gone by the time it is read: counted, never an error (the
    first chaos soak lost its results to one)."""
    import psutil

    count = rss = zombies = 0
    for p in psutil.process_iter():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                zombies += 1
                continue
            if "ray" in " ".join(p.cmdline() or [])[:200] or "VLLM" in (p.name() or ""):
                count, rss = count + 1, rss + p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return count, rss, zombies


def part_of(cmdline: str, name: str, harness: bool) -> str:
    """Which part of the system a process is, for the CPU each part takes in a phase. `harness`: this process
    or one it started (the cluster's processes are among them: `up` starts Ray from here)."""
    for part, marks in (("gateway", ("ServeReplica:gateway",)),
                        ("coordinator", ("ServeReplica:coordinator", "rlserve.runs.spec_reader")),
                        ("reward", ("ServeReplica:reward",)),
                        ("training", ("ServeReplica:rollout", "ServeReplica:reference", "ServeReplica:learner",
                                      "LearnerWorker"))):
        if any(m in cmdline for m in marks):
            return part
    if "VLLM" in name:
        return "training"
    if "ray" in cmdline:
        return "ray"
    return "harness" if harness else ""  # the callers and the abuser: this machine's cores serve them too


def harness_pids() -> set[int]:
    """This process and every process it started (the cluster's among them: `part_of` tells them apart)."""
    import psutil

    me = psutil.Process()
    return {me.pid} | {c.pid for c in me.children(recursive=True)}


def processes_by_part() -> Iterator[tuple[psutil.Process, str]]:
    """Each of the cluster's and this harness's processes, with its part (`part_of`)."""
    import psutil

    harness = harness_pids()
    for p in psutil.process_iter(["cmdline", "name"]):
        part = part_of(" ".join(p.info["cmdline"] or [])[:300], p.info["name"] or "", p.pid in harness)
        if part:
            yield p, part


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """Each of the cluster's and this harness's processes: (its part, CPU seconds so far)."""
    import psutil

    out = {}
    for p, part in processes_by_part():
        try:
            t = p.cpu_times()
            out[p.pid] = (part, t.user + t.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def cores_by_part(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                  seconds: float) -> dict[str, float]:
    """Cores each part kept busy between two `cpu_seconds` (a process started between them counts from 0)."""
    used: Counter = Counter()
    for pid, (part, cpu) in after.items():
        used[part] += cpu - before.get(pid, (part, 0.0))[1]
    return {part: round(cpu / seconds, 2) for part, cpu in sorted(used.items())}


def pin_the_rest(control_cores: list[int], harness_cores: list[int]) -> int:
    """Ray's own processes onto the control plane's cores, and this harness too unless `harness_cores` gives it
    cores of its own (`soak_cluster` placed the gateway and the services through the cluster file; these have no
    such key). The abuser's process, started later, inherits the harness's cores. Returns how many it pinned."""
    from rlserve.cpu_affinity import pin_process

    pinned = 0
    for p, part in processes_by_part():
        if part not in ("ray", "harness"):
            continue
        cores, flag = (harness_cores, "--harness-cores") if part == "harness" and harness_cores else \
            (control_cores, "--control-cores")
        try:
            pin_process(cores, flag, p.pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # gone meanwhile, or not ours
        pinned += 1
    return pinned


def chaos(seconds: float, rng: random.Random) -> list[str]:
    """Kill one of the services' processes every 60-120 s; returns what was killed."""
    import psutil

    killed = []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        time.sleep(min(rng.uniform(60, 120), max(0.0, stop - time.monotonic())))
        target = rng.choice(KILLABLE)
        procs = [p for p in psutil.process_iter(["cmdline"]) if any(
            f"ServeReplica:{target}" in c or (target == "LearnerWorker" and "LearnerWorker" in c)
            for c in p.info["cmdline"] or [])]
        if procs:
            procs[0].kill()
            killed.append(target)
    return killed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--callers", type=int, default=500)
    parser.add_argument("--phase-s", type=float, default=120)
    parser.add_argument("--callers-per-user", type=int, default=20)
    parser.add_argument("--chaos-s", type=float, default=0)
    parser.add_argument("--steps", type=int, default=None,
                        help="GRPO steps of the training run; by default enough to outlast the phases at 2 steps a "
                             "second (a 16-core machine's pace) and the chaos at ~1 s a step (the first chaos soak's "
                             "run of 650 steps ended 8 minutes into 30)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--control-cores", type=parse_cores, default=None,
                        help="e.g. 0 or 0-3: the gateway, coordinator and reward on these cores and rollout, reference "
                             "and learner on the others (the cluster file's cpu_cores keys), and Ray's own processes "
                             "and this harness pinned to them too (`pin_the_rest`), for every phase")
    parser.add_argument("--harness-cores", type=parse_cores, default=[],
                        help="with --control-cores: this harness (the callers and the abuser, who in a deployment "
                             "call from other machines) on these cores, apart from both the control plane and "
                             "training")
    parser.add_argument("--abuse-apart", action="store_true",
                        help="after the abuse phase, one phase for each kind of abuse alone (which one costs what)")
    parser.add_argument("--read-cache-ms", type=int, default=0,
                        help="the cluster file's read_cache_ms (how long the gateway keeps a read's answer)")
    args = parser.parse_args()
    if args.harness_cores and not args.control_cores:
        parser.error("--harness-cores needs --control-cores")
    if args.steps is None:
        args.steps = int(2 * (4 + 3 * args.abuse_apart) * args.phase_s + args.chaos_s) + 100
    random.seed(args.seed)

    from rlserve.cluster.lifecycle import down, up
    from rlserve.security.users import add_user
    from rlserve.v1 import coordinator_pb2 as pb

    root = Path(tempfile.mkdtemp(prefix="rlserve-soak-"))
    cluster = soak_cluster(root, args.read_cache_ms, args.control_cores, args.harness_cores)
    up(cluster)
    try:
        user_file = cluster.token_files[0]
        from rlserve.clients.coordinator import CoordinatorClient
        from rlserve.clients.credentials import Credentials

        with CoordinatorClient(cluster.grpc_endpoint, token_file=user_file) as client:
            run = client.submit(training_spec(args.steps))
        # Well-behaved users and the abuser, each with its own token and a run of its own that waits in
        # the queue behind the training run (cancelled at the end).
        tokens = [add_user(cluster.users_file, f"soak{u}", admin=False)
                  for u in range(max(1, args.callers // args.callers_per_user) + 1)]
        time.sleep(3)  # the gateway re-reads the users file within about a second
        users = []
        for user_token in tokens:
            with CoordinatorClient(cluster.grpc_endpoint, credentials=Credentials(token=user_token)) as client:
                users.append((user_token, client.submit(TINY).run_id))
        abuser, abuser_run = users.pop()
        with CoordinatorClient(cluster.grpc_endpoint, token_file=user_file) as client:
            while client.get(run.run_id).step < 1:  # past SFT and the first GRPO step
                time.sleep(2)
        rows = []
        if args.control_cores:
            print("pinned", pin_the_rest(args.control_cores, args.harness_cores), "processes", flush=True)
        procs_before, rss_before, _ = cluster_processes()
        abuser_pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        quiet_steps: list[dict[str, float]] = []
        abuses = {"abuse": ABUSES} | ({f"abuse: {kind}": (kind,) for kind in ABUSES} if args.abuse_apart else {})
        for phase in ("quiet", "load", *abuses, "quiet again"):
            idle = phase.startswith("quiet")
            callers = Callers(cluster.grpc_endpoint, users, 0 if idle else args.callers)
            t0 = time.time()
            cpu_before = cpu_seconds()

            async def both() -> dict[str, int]:
                jobs = [callers.run(args.phase_s)]
                if phase in abuses:
                    jobs.append(asyncio.get_running_loop().run_in_executor(
                        abuser_pool, abuse_in_own_process, cluster.grpc_endpoint, abuser, abuser_run, args.phase_s,
                        abuses[phase]))
                results = await asyncio.gather(*jobs)
                return results[1] if phase in abuses else {}

            answers = (time.sleep(args.phase_s) or {}) if idle else asyncio.run(both())
            cores = cores_by_part(cpu_before, cpu_seconds(), time.time() - t0)
            steps = step_times(cluster.runs_dir, run.run_id, t0, time.time())
            if idle:
                quiet_steps += steps
            lat = [seconds for _, seconds in callers.latencies]
            by_call: dict[str, list[float]] = {}
            for call, seconds in callers.latencies:
                by_call.setdefault(call, []).append(seconds)
            rows.append({"phase": phase, "calls": len(lat), "errors": len(callers.errors),
                         "error_codes": dict(Counter(callers.errors)),
                         "p50_ms": percentile(lat, 0.5) * 1e3, "p99_ms": percentile(lat, 0.99) * 1e3,
                         "max_ms": max(lat, default=float("nan")) * 1e3,
                         "p99_ms_outside_stalls": percentile(callers.latencies_outside_stalls(), 0.99) * 1e3,
                         "harness_lag_p99_ms": percentile(callers.loop_lags, 0.99) * 1e3,
                         "harness_lag_max_ms": max(callers.loop_lags, default=float("nan")) * 1e3,
                         "harness_stalled_s": sum(end - start for start, end in callers.stalls),
                         "steps": len(steps), **medians(steps),
                         "abuser": ", ".join(f"{k} {v}" for k, v in sorted(answers.items())),
                         "p99_ms_by_call": {call: round(percentile(v, 0.99) * 1e3, 1)
                                            for call, v in sorted(by_call.items())},
                         "cores": cores})
            print("phase", rows[-1], flush=True)
        abuser_pool.shutdown()
        admin_file = cluster.token_files[1]
        with CoordinatorClient(cluster.grpc_endpoint, token_file=admin_file) as client:
            for _, run_id in users + [(abuser, abuser_run)]:
                client.cancel(run_id)
        quiet = medians(quiet_steps)
        for row in rows:
            row.update({f"{part.removesuffix('_s')}_vs_quiet": row[part] / quiet[part] for part in STEP_PARTS})
        meta = {"callers": args.callers, "phase_s": args.phase_s, "read_cache_ms": args.read_cache_ms,
                "abuse_apart": args.abuse_apart,
                "control_cores": args.control_cores, "harness_cores": args.harness_cores, "cpus": os.cpu_count()}
        if args.chaos_s:
            killed = chaos(args.chaos_s, random.Random(args.seed))
            with CoordinatorClient(cluster.grpc_endpoint, token_file=admin_file) as client:
                deadline = time.monotonic() + 3600  # the run goes on to its last step
                while True:
                    try:
                        final = client.get(run.run_id)
                    except Exception:  # noqa: BLE001 - the coordinator or gateway may still be restarting
                        time.sleep(5)
                        continue
                    if final.state in (pb.RUN_STATE_CANCELLED, pb.RUN_STATE_FAILED, pb.RUN_STATE_SUCCEEDED) \
                            or time.monotonic() > deadline:
                        break
                    time.sleep(5)
                stuck = [r.run_id for r in client.list() if r.state not in (
                    pb.RUN_STATE_CANCELLED, pb.RUN_STATE_FAILED, pb.RUN_STATE_SUCCEEDED)]
            meta.update({"chaos_s": args.chaos_s, "killed": killed, "final_state": pb.RunState.Name(final.state),
                         "ledger_in_flight": final.ledger.in_flight, "stuck_runs": stuck,
                         "processes_before": procs_before, "rss_before_mb": rss_before / 2**20})
            procs_after, rss_after, zombies = cluster_processes()
            meta.update({"processes_after": procs_after, "rss_after_mb": rss_after / 2**20, "zombies_after": zombies})
    finally:
        down(cluster)
    print(table(rows, ["phase", "calls", "errors", "p50_ms", "p99_ms", "max_ms", "p99_ms_outside_stalls",
                       "harness_stalled_s", "steps", "step_s", "step_vs_quiet", "generate_vs_quiet", "train_vs_quiet",
                       "learner_vs_quiet", "abuser"]))
    parts = sorted({part for row in rows for part in row["cores"]})
    calls = sorted({call for row in rows for call in row["p99_ms_by_call"]})
    print(table([{"phase": row["phase"], **{f"{p} cores": row["cores"].get(p, 0.0) for p in parts},
                  **{f"p99 {c} ms": row["p99_ms_by_call"].get(c, "") for c in calls}} for row in rows],
                ["phase", *(f"{p} cores" for p in parts), *(f"p99 {c} ms" for c in calls)]))
    if args.chaos_s:
        print({k: v for k, v in meta.items() if k not in ("callers", "phase_s")})
    print("wrote", record("soak", rows, meta))


if __name__ == "__main__":
    main()
