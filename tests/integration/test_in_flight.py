"""Direct weight transfer and in-flight updates on the real cluster.

The learner sends a new version straight to both rollout replicas through
vLLM's weight-transfer API (the project's gloo engine) while a long
generation runs there: the generation completes, its samples name both
versions, and every token's logprob is the learner's under the version that
generated it. A replica killed in the middle of a transfer comes back on the
newest version (from the weight store's copy) and the other one is not held up.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import ray
from ray import serve

from rlserve.models import resolve_model
from rlserve.v1 import common_pb2, learner_pb2, learner_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from rlserve.weights.fleet import fleet_name
from rlserve.weights.store import DEFAULT_STORE_NAME, STORE_NAMESPACE
from tests.integration.rollout_support import logprob_errors

RUN = "in-flight-test"
PROMPTS = [[8, 11, 41, 12, 9, 47], [5, 6, 42, 7]]
TOKENS = 110  # the test cluster's max_model_len is 128
SFT_BATCH = [learner_pb2.TrainSequence(token_ids=[8, 11, 41, 12, 9, 47, 6, 7, 5, 2], prompt_length=6)] * 8


def long_generate(stub, n: int, seed: int) -> rollout_pb2.GenerateResponse:
    return stub.Generate(rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=p)) for p in PROMPTS], num_samples=n,
        sampling=common_pb2.SamplingParams(temperature=1.0, max_new_tokens=TOKENS, min_new_tokens=TOKENS, seed=seed)), timeout=600)


class Background(threading.Thread):
    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args, self.result, self.error = fn, args, None, None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as err:  # noqa: BLE001 - re-raised by get()
            self.error = err

    def get(self, timeout: float = 600):
        self.join(timeout)
        assert not self.is_alive(), "timed out"
        if self.error is not None:
            raise self.error
        return self.result


class KeepGenerating:
    """Long generations kept running until `stop`, each stream starting its next as soon as one ends, so a transfer
    reaching its finish step meets running requests however long training took before it."""

    def __init__(self, stub, streams: int, n: int):
        self.stub, self.n = stub, n
        self.done = threading.Event()
        self.errors: list[tuple[float, grpc.RpcError]] = []
        self.streams = [Background(self._stream, seed) for seed in range(streams)]

    def _stream(self, seed: int) -> None:
        while not self.done.is_set():
            try:
                long_generate(self.stub, self.n, seed)
            except grpc.RpcError as err:
                self.errors.append((time.time(), err))
                self.done.wait(0.5)  # the killed replica's: Serve may route there until it learns it is gone

    def stop(self) -> list[tuple[float, grpc.RpcError]]:
        """Waits for the generations under way; returns the calls that failed (when, the error)."""
        self.done.set()
        for stream in self.streams:
            stream.get()
        return self.errors

    def __enter__(self) -> KeepGenerating:
        return self

    def __exit__(self, *exc) -> None:
        """Stops the streams whatever the test did: left running after a failed assertion, they kept the shared
        cluster's engines busy for the rest of the suite (and the tests after it failed on a loaded machine)."""
        self.done.set()


def replica_versions(stub, calls: int = 12) -> dict[str, tuple[str, int]]:
    seen = {}
    for _ in range(calls):
        info = stub.GetInfo(rollout_pb2.GetInfoRequest())
        seen[info.replica_id] = (info.run_id, info.weight_version)
    return seen


def generating(stub, n: int, seeds: list[int]) -> list[Background]:
    """Long generations under way, one per seed. GetInfo cannot show where they run (Serve sends it to the least
    busy replica, and may send several Generates to one replica), so they get a second to reach the engines; each
    test checks from what it observes that its update met them running."""
    jobs = [Background(long_generate, stub, n, seed) for seed in seeds]
    time.sleep(1.0)
    for job in jobs:
        if not job.is_alive():
            job.get()  # raises its error, if any
    assert any(job.is_alive() for job in jobs), "the generations ended before the update"
    return jobs


def wait_for_versions(stub, version: int, timeout_s: float = 240) -> dict[str, tuple[str, int]]:
    """Both replicas serve `version` of this test's run."""
    deadline = time.time() + timeout_s
    while True:
        status = serve.status().applications["rollout"]
        versions = replica_versions(stub) if status.status == "RUNNING" else {}
        if len(versions) == 2 and set(versions.values()) == {(RUN, version)}:
            return versions
        assert time.time() < deadline, f"replicas are not on version {version}: {versions} ({status.status})"
        time.sleep(1)


@pytest.fixture(scope="module")
def learner(channel):
    stub = learner_pb2_grpc.LearnerStub(channel)
    spec = "policy: {max_total_sequence_length: 64, generation: {max_new_tokens: 8}}"
    stub.Configure(learner_pb2.ConfigureRequest(run_id=RUN, spec_yaml=spec))
    return stub


def train(learner, version: int) -> None:
    """One step, making `version`. Done before the generations an export must meet start: a slow machine's step
    could outlast them."""
    learner.TrainStep(learner_pb2.TrainStepRequest(run_id=RUN, loss_name="sft", sequences=SFT_BATCH,
                                                   learning_rate=1e-2, expected_weight_version=version - 1))


def export(learner, in_flight: bool) -> Background:
    return Background(lambda: learner.ExportWeights(learner_pb2.ExportWeightsRequest(
        run_id=RUN, direct=True, in_flight=in_flight), timeout=600))


def test_a_direct_update_lands_in_the_middle_of_a_long_generation(channel, learner, ray_driver):
    stub = rollout_pb2_grpc.RolloutStub(channel)
    first = learner.ExportWeights(learner_pb2.ExportWeightsRequest(run_id=RUN, direct=True))
    assert first.weight_version == 0 and first.receivers == 0  # a session's first version: the store copy only
    wait_for_versions(stub, 0)

    train(learner, 1)
    # 4 x 2 prompts x 96 samples x 110 tokens: a few seconds even on an idle machine (32 samples could end
    # within the second that `generating` gives them to reach the engines).
    running = generating(stub, 96, [5, 6, 7, 8])
    exported = export(learner, in_flight=True).get()
    assert exported.weight_version == 1 and exported.receivers == 2 and not exported.failed
    assert exported.direct_bytes == 2 * exported.num_bytes  # once to each replica, no copy through the store
    responses = [job.get() for job in running]
    for r in responses:  # each names the oldest version in it (0 unless Serve queued it behind another)
        assert r.weight_version == min(v.version for c in r.completions for s in c.samples for v in s.version_runs)

    samples = [s for resp in responses for c in resp.completions for s in c.samples]
    assert all(len(s.token_ids) == TOKENS and s.finish_reason == common_pb2.FINISH_REASON_LENGTH for s in samples)
    runs = [[(r.version, r.start, r.end) for r in s.version_runs] for s in samples]
    mixed = [r for r in runs if len(r) == 2]
    assert mixed, f"the update should land while the samples were generating: {runs[:3]}"
    assert all(r[0][0] == 0 and r[1][0] == 1 and r[0][2] == r[1][1] and r[1][2] == TOKENS for r in mixed)

    # Checkpoints and exports go inside the runs directory (relative paths are taken from there).
    v1 = ray_driver.runs_dir / RUN / "v1"
    learner.SaveCheckpoint(learner_pb2.SaveCheckpointRequest(run_id=RUN, path=f"{RUN}/ckpt", hf_path=str(v1)))
    errors = {0: [e for r in responses for e in logprob_errors(r, resolve_model("preset:tiny"))],
              1: [e for r in responses for e in logprob_errors(r, v1)]}
    for k, sample_runs in enumerate(runs):
        for version, start, end in sample_runs:
            assert max(errors[version][k][start:end]) < 1e-4, (k, version, start, end)
    k = runs.index(mixed[0])
    switch = mixed[0][1][1]
    assert max(errors[0][k][switch:]) > 1e-3  # the new weights really differ from the old


def test_a_replica_killed_during_a_transfer_comes_back_on_the_newest_version(channel, learner, ray_driver):
    stub = rollout_pb2_grpc.RolloutStub(channel)
    fleet = ray.get_actor(fleet_name(DEFAULT_STORE_NAME), namespace=STORE_NAMESPACE)
    wait_for_versions(stub, 1)
    # Without in-flight updates each replica finishes its running requests before loading, which
    # holds the transfer at its last step long enough to kill a replica in it.
    # The replicas' actors, looked up now: the kill below must follow the observation at once.
    replicas = {a["name"]: ray.get_actor(a["name"], namespace="serve") for a in ray.util.list_named_actors(
        all_namespaces=True) if a["namespace"] == "serve" and "rollout" in a["name"]}
    train(learner, 2)
    with KeepGenerating(stub, streams=4, n=64) as running:
        time.sleep(2.0)  # the generations reach the engines first (a transfer ahead of them met none running once)
        exporting = export(learner, in_flight=False)
        # The victim is a replica seen waiting at finish for a while: one busy with generations. A replica
        # that Serve gave no request answers finish at once, and killing it then would kill it after the transfer.
        deadline = time.time() + 120
        waiting_since: dict[str, float] = {}
        while True:
            pending = ray.get(fleet.pending.remote())
            now = time.time()
            waiting_since = {m: waiting_since.get(m, now) for m, kinds in pending.items() if "finish" in kinds}
            held = [m for m, since in waiting_since.items() if now - since >= 0.3]
            if held:
                break
            if not exporting.is_alive():
                exporting.get()  # its error, if it failed
            assert now < deadline and exporting.is_alive(), f"the transfer never waited at finish: {pending}"
            time.sleep(0.02)
        victim = held[0]
        killed_at = time.time()
        ray.kill(next(actor for name, actor in replicas.items() if victim in name), no_restart=True)

        exported = exporting.get()
        assert exported.weight_version == 2 and exported.receivers == 2
        assert any(victim in f for f in exported.failed), exported.failed
        failed = running.stop()  # requests on the killed replica fail; the others complete
    assert all(when >= killed_at for when, _ in failed), [err for when, err in failed if when < killed_at]
    versions = wait_for_versions(stub, 2)
    assert victim not in versions


def abandon_a_round(fleet) -> None:
    """What a learner worker killed mid-round leaves behind: every replica started a direct round (its engine's
    update lock held) that no further step will follow."""
    _, members = ray.get(fleet.members.remote())
    payload = {"start": {"in_flight": False, "run_id": "abandoned"},
               "update_info": {"names": [], "dtype_names": [], "shapes": [], "bucket": True}}
    ray.get(fleet.command.remote("update", {m.member_id: payload for m in members}, 30))


def test_a_round_abandoned_by_its_sender_holds_up_neither_the_next_round_nor_a_load(channel, learner, ray_driver):
    stub = rollout_pb2_grpc.RolloutStub(channel)
    fleet = ray.get_actor(fleet_name(DEFAULT_STORE_NAME), namespace=STORE_NAMESPACE)
    wait_for_versions(stub, 2)

    # The next round's start ends the abandoned one at once.
    abandon_a_round(fleet)
    train(learner, 3)
    exported = export(learner, in_flight=False).get()
    assert exported.weight_version == 3 and exported.receivers == 2 and not exported.failed, exported
    wait_for_versions(stub, 3)

    # A publication in the store waits for the open round, which expires after the rollout's
    # weight_transfer_timeout_s; meanwhile both replicas go on polling their mailboxes (a replica that
    # stopped would be dropped from the fleet after fleet.MEMBER_LEASE_S and never hear of a version again).
    abandon_a_round(fleet)
    load = Background(lambda: stub.UpdateWeights(rollout_pb2.UpdateWeightsRequest(
        version=100, safetensors_path=str(resolve_model("preset:tiny")), force=True), timeout=300))
    time.sleep(20)
    assert len(ray.get(fleet.members.remote())[1]) == 2, "a replica stopped polling while a load waited"
    assert load.get(300).weight_version == 100
    wait_for_versions(stub, 100)
