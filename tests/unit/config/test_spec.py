"""The run spec: defaults, NeMo-RL key names, and errors that name the key path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlserve.catalog import ADVANTAGE_ESTIMATORS, DEFAULT_BACKEND, LEARNER_BACKENDS, LOSSES, SUPERVISED_LOSSES
from rlserve.config import RunSpec, SpecError, load_spec, parse_spec, spec_to_yaml
from rlserve.config.policy import PolicyCfg
from rlserve.config.spec import LEGACY_ADV_ESTIMATOR_KEYS, Section


def problems(data) -> list[str]:
    with pytest.raises(SpecError) as err:
        parse_spec(data)
    return err.value.problems


def test_defaults_are_valid_and_round_trip():
    spec = parse_spec({})
    assert spec.policy.backend == "dtensor"
    assert spec.grpo.max_age(cores_shared=False) == 0
    again = load_spec(spec_to_yaml(spec))
    assert again == spec


def test_nemo_rl_keys_are_accepted():
    spec = parse_spec({
        "policy": {"model_name": "preset:tiny", "dtensor_cfg": {"tensor_parallel_size": 1},
                   "generation": {"temperature": 0.7, "vllm_cfg": {"tensor_parallel_size": 1}},
                   "sequence_packing": {"enabled": True}},
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 2, "max_num_steps": 3,
                 "async_grpo": {"enabled": True, "max_trajectory_age_steps": 2}},
        "loss_fn": {"reference_policy_kl_penalty": 0.01, "ratio_clip_min": 0.2, "ratio_clip_max": 0.28,
                    "use_importance_sampling_correction": True, "token_level_loss": True},
    })
    assert spec.grpo.max_age(cores_shared=True) == 2  # explicitly on: whatever the cluster
    assert spec.batch_size == 8


def test_async_auto_is_sync_only_where_generation_and_training_share_cpu_cores():
    auto = parse_spec({"grpo": {"async_grpo": {"enabled": "auto", "max_trajectory_age_steps": 2}}}).grpo
    assert auto.max_age(cores_shared=True) == 0 and auto.max_age(cores_shared=False) == 2
    off = parse_spec({"grpo": {"async_grpo": {"enabled": False, "max_trajectory_age_steps": 2}}}).grpo
    assert off.max_age(cores_shared=False) == 0
    with pytest.raises(SpecError, match="grpo.async_grpo.enabled"):
        parse_spec({"grpo": {"async_grpo": {"enabled": "sometimes"}}})


def test_unknown_key_names_path_and_suggests():
    (p,) = problems({"grpo": {"num_prompts_per_stpe": 8}})
    assert p.startswith("grpo.num_prompts_per_stpe: unknown key")
    assert "did you mean 'num_prompts_per_step'" in p


def test_bad_value_names_path():
    (p,) = problems({"policy": {"generation": {"temperature": -1}}})
    assert p.startswith("policy.generation.temperature:")


@pytest.mark.parametrize("data, path", [
    ({"data": {"task": "addtion"}}, "data.task"),
    ({"data": {"task_args": {"digts": 3}}}, "data.task_args.digts"),
    ({"data": {"task": "jsonl"}}, "data.train_path"),
    ({"policy": {"megatron_cfg": {"enabled": True}, "dtensor_cfg": {"enabled": True}}},
     "policy.megatron_cfg.enabled"),
    ({"policy": {"model_name": "preset:huge"}}, "policy.model_name"),
    ({"reward": {"endpoint": "nohost"}}, "reward.endpoint"),
    ({"policy": {"generation": {"max_new_tokens": 200}}}, "policy.generation.max_new_tokens"),
    ({"loss_fn": {"sequence_level_importance_ratios": True}}, "loss_fn.sequence_level_importance_ratios"),
    ({"algorithm": "sft", "sft": {"enabled": True}}, "sft.enabled"),
    ({"algorithm": "dpo", "data": {"task": "jsonl", "train_path": "p.jsonl"},
      "policy": {"dtensor_cfg": {"lora_cfg": {"enabled": True}}}}, "policy.dtensor_cfg.lora_cfg.enabled"),
    ({"algorithm": "dpo", "data": {"task": "jsonl", "train_path": "p.jsonl"},
      "policy": {"sequence_packing": {"enabled": True, "train_mb_tokens": 128}}},
     "policy.sequence_packing.train_mb_tokens"),
    ({"algorithm": "ppo"}, "algorithm"),
    ({"grpo": {"num_prompts_per_step": 4096, "num_generations_per_prompt": 16, "use_dynamic_sampling": True,
               "batch_multiplier": 2}}, "grpo.batch_multiplier"),
    ({"grpo": {"max_rollout_turns": 4}}, "grpo.max_rollout_turns"),
    ({"env": {"enabled": True, "name": "chess"}}, "env.name"),
    ({"env": {"enabled": True, "endpoint": "nohost"}}, "env.endpoint"),
    ({"env": {"enabled": True, "timeout_s": 0}}, "env.timeout_s"),
    ({"env": {"enabled": True, "args": {"x": float("nan")}}}, "env.args"),
])
def test_cross_field_errors_name_the_key(data, path):
    assert problems(data)[0].startswith(path + ":")


def test_an_environment_spec_and_its_defaults():
    spec = parse_spec({"env": {"enabled": True, "name": "guess_number", "args": {"max_number": 8}},
                       "grpo": {"max_rollout_turns": 5}})
    assert spec.grpo.max_rollout_turns == 5 and spec.env.timeout_s == 30.0
    assert spec.env.environment([]).args == {"max_number": 8}
    # single_turn scores with the run's reward functions unless it names its own.
    one = parse_spec({"env": {"enabled": True}, "reward": {"functions": [{"name": "format"}]}})
    assert one.env.environment(one.reward.functions).args["functions"][0]["name"] == "format"
    assert parse_spec({}).grpo.max_rollout_turns == 1 and not parse_spec({}).env.enabled


def test_megatron_enabled_alone_switches_backend():
    assert parse_spec({"policy": {"megatron_cfg": {"enabled": True}}}).policy.backend == "megatron"


def test_backend_names_and_sections_come_from_the_registry():
    assert parse_spec({}).policy.backend == DEFAULT_BACKEND
    for name in LEARNER_BACKENDS.names:
        assert f"{name}_cfg" in PolicyCfg.model_fields, f"backend {name!r} has no policy.{name}_cfg section"
    (p,) = problems({"policy": {"dtensor_cfg": {"enabled": False}}})
    assert p.startswith("policy.dtensor_cfg.enabled: no learner backend")
    assert all(f"policy.{name}_cfg.enabled" in p for name in LEARNER_BACKENDS.names)


def test_the_spec_validates_without_importing_torch():
    code = ("import sys; from rlserve.config import parse_spec; "
            "parse_spec({'loss_fn': {'name': 'grpo'}, 'grpo': {'adv_estimator': {'name': 'grpo'}}}); "
            "print('torch' in sys.modules)")
    libs = str(Path(__file__).resolve().parents[3] / "libs")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": libs})
    assert out.stdout.strip() == "False"


def test_loss_and_advantage_estimator_names_come_from_their_registries():
    spec = parse_spec({})
    assert spec.loss_fn.name == "grpo" and spec.grpo.adv_estimator.name == "grpo"
    rl_losses = [n for n in LOSSES.names if n not in SUPERVISED_LOSSES]
    (p,) = problems({"loss_fn": {"name": "ppo"}})
    assert p == f"loss_fn.name: unknown loss 'ppo'; valid: {', '.join(rl_losses)}"
    (p,) = problems({"loss_fn": {"name": "sft"}})  # the warm start's loss, not a run's RL loss
    assert p.startswith("loss_fn.name:")
    (p,) = problems({"grpo": {"adv_estimator": {"name": "gae"}}})
    assert p == f"grpo.adv_estimator.name: unknown advantage estimator 'gae'; valid: {', '.join(ADVANTAGE_ESTIMATORS.names)}"


def test_advantage_estimator_defaults_are_nemo_rl_grpo():
    est = parse_spec({}).grpo.adv_estimator
    assert est.normalize_rewards is True and est.use_leave_one_out_baseline is False


def test_legacy_advantage_keys_move_into_adv_estimator():
    spec = parse_spec({"grpo": {"normalize_rewards": False, "use_leave_one_out_baseline": True,
                                "adv_estimator": {"name": "grpo"}}})
    est = spec.grpo.adv_estimator
    assert (est.normalize_rewards, est.use_leave_one_out_baseline) == (False, True)
    assert "normalize_rewards" not in spec.grpo.model_fields
    assert load_spec(spec_to_yaml(spec)) == spec  # written back in the new form
    (p,) = problems({"grpo": {"normalize_rewards": False, "adv_estimator": {"normalize_rewards": True}}})
    assert p.startswith("grpo.normalize_rewards: given twice") and "grpo.adv_estimator.normalize_rewards" in p


def test_optimizer_has_no_name():
    (p,) = problems({"policy": {"optimizer": {"name": "torch.optim.AdamW"}}})
    assert p.startswith("policy.optimizer.name: unknown key")


def _paths(model: type[Section], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, Section):
            out += _paths(ann, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out


SECTIONS = [name for name, f in RunSpec.model_fields.items() if isinstance(f.annotation, type)
            and issubclass(f.annotation, Section) and f.annotation.model_config.get("extra") == "forbid"]


@settings(max_examples=60, deadline=None)
@given(section=st.sampled_from(SECTIONS), key=st.from_regex(r"[a-z][a-z_]{2,20}", fullmatch=True))
def test_any_unknown_key_is_rejected_with_its_path(section, key):
    known = set(RunSpec.model_fields[section].annotation.model_fields)
    if section == "grpo":
        known |= set(LEGACY_ADV_ESTIMATOR_KEYS)
    if section == "loss_fn":
        known |= {"use_cispo"}  # NeMo-RL's spelling of loss_fn.name: cispo
    if key in known:
        return
    (p,) = problems({section: {key: 1}})
    assert p.startswith(f"{section}.{key}: unknown key")


NUMERIC = [p for p in _paths(RunSpec) if p.split(".")[-1] in {
    "num_prompts_per_step", "num_generations_per_prompt", "max_num_steps", "max_new_tokens", "top_p",
    "ratio_clip_min", "save_period", "num_workers", "train_micro_batch_size", "lr", "max_trajectory_age_steps"}]


@settings(max_examples=80, deadline=None)
@given(path=st.sampled_from(NUMERIC), value=st.one_of(st.integers(-10**6, -1), st.just("many"), st.just([1])))
def test_invalid_numbers_are_rejected_with_their_path(path, value):
    data: dict = {}
    node = data
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    assert any(p.startswith(path + ":") for p in problems(data))


@pytest.mark.parametrize("text, path", [
    # The reproductions: each was accepted, and hurt the cluster later.
    ("grpo: {max_num_steps: 1180591620717411303424}", "grpo.max_num_steps"),
    ("data: {num_train: 1000000000}", "data.num_train"),
    ("policy: {generation: {temperature: .inf}}", "policy.generation.temperature"),
    ("policy: {generation: {temperature: .nan}}", "policy.generation.temperature"),
    ("policy: {generation: {top_p: .nan}}", "policy.generation.top_p"),
    ("name: " + "n" * 10_000, "name"),
    ("name: ../../escape", "name"),
    ("loss_fn: {ratio_clip_max: .inf}", "loss_fn.ratio_clip_max"),
    ("grpo: {num_prompts_per_step: 4096, num_generations_per_prompt: 1024}", "grpo.num_generations_per_prompt"),
    ("policy: {generation: {stop_strings: ['']}}", "policy.generation.stop_strings.0"),
    ("grpo: {seed: 9223372036854775807}", "grpo.seed"),
    ("reward: {functions: [{name: format, args: {pattern: 2024-01-01}}]}", "reward.functions.0.args"),
])
def test_every_size_is_bounded_and_every_float_finite(text, path):
    with pytest.raises(SpecError) as err:
        load_spec(text)
    assert err.value.problems[0].startswith(path + ":"), err.value.problems
    assert len(str(err.value)) < 2000, "errors quote at most a short prefix of what they refuse"


@pytest.mark.parametrize("text, problem", [
    ("name: " + "n" * (300 * 1024), "the limit is"),
    ("a: &x [1, 2]\nb: *x", "aliases"),
    ("[" * 50_000, "nested deeper than"),
    ("data: {task_args: " + "{a: " * 40 + "1" + "}" * 40 + "}", "nested deeper than"),
])
def test_spec_documents_are_bounded_before_parsing(text, problem):
    with pytest.raises(SpecError) as err:
        load_spec(text)
    assert problem in str(err.value)


@pytest.mark.parametrize("text, problem", [
    ("grpo: {max_num_steps: 3}\ngrpo: {max_num_steps: 4}", "grpo: given twice in one mapping (line 2)"),
    ("grpo: {max_num_steps: 3, max_num_steps: 4}", "max_num_steps: given twice"),
    ("grpo: {max_num_steps: true}", "grpo.max_num_steps: a number, not true"),
    ("policy: {max_grad_norm: false}", "policy.max_grad_norm: a number, not false"),
    ("grpo: {max_num_steps: " + "9" * 5000 + "}", "a value cannot be read"),
    ("", "an empty spec"),
    ("# nothing but a comment\n", "an empty spec"),
    ("data: {train_path: /data/train.jsonl}", "data.train_path: the 'addition' task generates its examples"),
    ("a: [" + ",".join(["1"] * 120_000) + "]", "more than 20000 values"),
])
def test_specs_that_would_be_misread_or_cost_too_much_are_refused(text, problem):
    """Each was accepted before (the last key silently won, true became 1, an empty spec queued a full
    default run, a file path was ignored) or failed with INTERNAL or after seconds of parsing."""
    with pytest.raises(SpecError) as err:
        load_spec(text)
    assert problem in str(err.value)
