"""The algorithms beyond GRPO's defaults, end to end on the shared cluster: DAPO's dynamic sampling and
overlong shaping, CISPO's loss, and REINFORCE++ with the KL in the reward (reference service ->
coordinator -> per-token advantages through the object store -> learner), and on-policy distillation
from a teacher the reference service scores with. Each run finishes with its records agreeing and
reports the algorithm's own metrics."""

from __future__ import annotations

import grpc
import pytest

from rlserve.clients.coordinator import CoordinatorClient
from rlserve.v1 import coordinator_pb2 as pb
from tests.integration.runs_support import assert_records_agree, events_until_end, metric_events, spec


@pytest.fixture(scope="module")
def client(test_cluster):
    with CoordinatorClient(test_cluster.endpoint) as c:
        yield c


def finished(client: CoordinatorClient, text: str) -> tuple[pb.Run, list[dict[str, float]]]:
    run = client.submit(text)
    events = events_until_end(client, run.run_id)
    run = client.get(run.run_id)
    assert run.state == pb.RUN_STATE_SUCCEEDED, run.error
    assert_records_agree(run, events)
    return run, metric_events(events)


def test_dapo_dynamic_sampling_and_overlong_shaping(client):
    run, steps = finished(client, spec(
        grpo__max_num_steps=2, grpo__val_period=0, grpo__use_dynamic_sampling=True,
        grpo__dynamic_sampling_max_gen_batches=3,
        grpo__reward_shaping={"enabled": True, "overlong_buffer_length": 2}, loss_fn__ratio_clip_max=0.28))
    for m in steps:
        assert 1 <= m["dynamic_sampling/num_gen_batches"] <= 3 and 0 <= m["dynamic_sampling/filtered_fraction"] < 1
        assert m["reward/overlong_penalty_mean"] <= 0
        # Full batches unless the bound was reached (then the step says how many groups it lacked).
        assert m["batch/groups_trained"] + m["dynamic_sampling/groups_short"] == 8
    assert run.ledger.generated >= 2 * 8 * 4


def test_cispo(client):
    _, steps = finished(client, spec(grpo__max_num_steps=2, grpo__val_period=0, loss_fn={
        "name": "cispo", "ratio_clip_min": 1.0, "ratio_clip_max": 5.0, "use_importance_sampling_correction": True},
        policy__train_global_batch_size=16))  # two updates per step: the weight moves off 1
    assert all("loss/policy_gradient" in m and "policy/clip_fraction" in m for m in steps)


def test_reinforce_plus_plus_with_the_kl_in_the_reward(client):
    _, steps = finished(client, spec(
        grpo__max_num_steps=2, grpo__val_period=0, grpo__adv_estimator={"name": "reinforce_plus_plus"},
        loss_fn={"use_kl_in_reward": True, "reference_policy_kl_penalty": 0.05, "reference_policy_kl_type": "k1"}))
    for m in steps:
        assert m["timing/reference_s"] > 0  # the coordinator asked the reference service
        assert m.get("loss/kl", 0.0) == 0.0  # and the loss has no KL term


def sharp_teacher(models_dir) -> str:
    """Another tiny model whose next-token distributions are peaked (its final norm scaled by 8, so its
    logits are 8x the random model's): a teacher the near-uniform student is measurably far from."""
    import shutil

    from safetensors.torch import load_file, save_file

    from rlserve.models import resolve_model

    folder = models_dir / "sharp-teacher"
    if not folder.exists():
        shutil.copytree(resolve_model("preset:tiny", 1), folder)
        weights = load_file(folder / "model.safetensors")
        weights["model.norm.weight"] = weights["model.norm.weight"] * 8
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


def test_on_policy_distillation_moves_the_student_toward_its_teacher(client, test_cluster):
    """The teacher (the same tokenizer, other and sharper weights) scores the student's samples through
    the reference service; trained on those per-token log-ratios alone, the student's reverse KL to the
    teacher falls over 20 steps."""
    _, steps = finished(client, spec(
        grpo__max_num_steps=20, grpo__val_period=0, grpo__adv_estimator={"name": "on_policy_distillation"},
        teacher={"model_name": sharp_teacher(test_cluster.models_dir)}, policy__optimizer={"kwargs": {"lr": 3e-3}},
        grpo__num_prompts_per_step=16))
    kl = [m["distillation/reverse_kl"] for m in steps]
    assert len(kl) == 20 and all(m["timing/reference_s"] > 0 for m in steps)
    assert all(m["batch/trajectories_trained"] == 16 * 4 for m in steps)  # tied rewards are no reason to drop
    first, last = sum(kl[:5]) / 5, sum(kl[-5:]) / 5
    # Per-token KL on 64 fresh samples a step is noisy (measured: 1.60 -> 1.20 and 1.90 -> 1.77 between the
    # first and last five steps); a student pushed the wrong way moves away from the teacher instead.
    assert first > 0.5 and last < 0.9 * first, [round(k, 3) for k in kl]


def test_a_run_scored_by_a_reward_model_and_a_judge(client, test_cluster):
    """The reward app's model-backed functions in a run: the classifier's score is the reward, the judge
    (weight 0) reports its unparsable answers in the step's metrics; a folder off the allow-list is refused
    at SubmitRun, naming the key."""
    from tests.support.reward_models import make_classifier

    folder = test_cluster.models_dir / "reward" / "run-classifier"
    make_classifier(folder, seed=3)
    judge = {"name": "llm_judge", "weight": 0.0, "args": {"model": "preset:tiny-chat", "min_score": 1000,
                                                          "max_score": 2000, "max_new_tokens": 4}}
    _, steps = finished(client, spec(grpo__max_num_steps=2, grpo__val_period=0, reward__functions=[
        {"name": "reward_model", "args": {"model": str(folder), "sigmoid": True}}, judge]))
    for m in steps:
        assert 0 < m["reward/mean"] < 1 and m["reward/std"] > 0  # a sigmoid of the classifier's logit
        assert m["reward/llm_judge/unparsed"] == 1.0
    off_the_list = {"name": "reward_model", "args": {"model": str(test_cluster.models_dir)}}
    with pytest.raises(grpc.RpcError) as err:
        client.submit(spec(reward__functions=[off_the_list]))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert err.value.details().startswith("spec_yaml: reward.functions.0.args.model:")
