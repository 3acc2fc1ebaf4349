"""The name registries: loud on unknown names, lazy imports, and open to the plug-ins a cluster enables.

The example plug-in package (tests/plugins: a loss and an advantage estimator declared as entry points)
is installed for these tests by putting its folder on the import path; the cluster file's `plugins`
section, carried by RLSERVE_PLUGINS, decides whether anything of it is used.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from rlserve.algorithms.interfaces import LossInputs
from rlserve.algorithms.metrics import finalize_metrics
from rlserve.algorithms.registry import advantage_estimator, make_loss
from rlserve.catalog import ADVANTAGE_ESTIMATORS, LOSSES, OPEN_REGISTRIES, TASKS, PluginsCfg
from rlserve.cluster.config import load_cluster_file
from rlserve.cluster.serve_config import APPS, app_args
from rlserve.config import SpecError, parse_spec
from rlserve.registry import PLUGINS_ENV, PluginError, Registry, import_object
from rlserve.runs.spec_reader import SpecReader

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_PACKAGE = "rlserve-example-plugin"
PLUGIN_SPEC = {"loss_fn": {"name": "counted_grpo"}, "grpo": {"adv_estimator": {"name": "centered"}}}


@pytest.fixture
def installed(monkeypatch):
    """The example plug-in package installed where this process imports from, enabled by nothing yet."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "plugins"))
    monkeypatch.delenv(PLUGINS_ENV, raising=False)


def enable(monkeypatch, **section) -> None:
    """This process as a process of a cluster whose cluster file has `plugins: section`."""
    monkeypatch.setenv(PLUGINS_ENV, PluginsCfg(**section).env()[PLUGINS_ENV])


def problems(data) -> list[str]:
    with pytest.raises(SpecError) as err:
        parse_spec(data)
    return err.value.problems


def test_unknown_name_fails_listing_the_valid_ones():
    colours = Registry("colour", {"red": 1, "blue": 2})
    assert colours.names == ("red", "blue") and colours["blue"] == 2 and "red" in colours
    with pytest.raises(ValueError, match="unknown colour 'green'; valid: red, blue"):
        colours["green"]


def test_an_open_registry_holds_import_paths_only():
    with pytest.raises(TypeError, match="open"):
        Registry("colour", {"red": 1}, "rlserve.colours")


def test_import_object_resolves_module_or_file_and_attribute(tmp_path):
    assert import_object("rlserve.registry:Registry") is Registry
    source = tmp_path / "mine.py"
    source.write_text("reward = 3\nother = 4\n")
    assert import_object(f"{source}:other") == 4 and import_object(str(source), "reward") == 3
    for path, says in (("rlserve.registry:Nothing", "no attribute 'Nothing'"),
                       ("no_such_module_xyz:f", "cannot import"), (f"{tmp_path}/gone.py:f", "no such file"),
                       ("rlserve.registry", "module:attribute")):
        with pytest.raises(ValueError, match=says):
            import_object(path)


def test_an_installed_package_adds_nothing_the_cluster_did_not_enable(installed):
    assert "counted_grpo" not in LOSSES.names and "centered" not in ADVANTAGE_ESTIMATORS.names
    assert problems(PLUGIN_SPEC) == [
        f"grpo.adv_estimator.name: unknown advantage estimator 'centered'; valid: "
        f"{', '.join(ADVANTAGE_ESTIMATORS.builtins)}",
        "loss_fn.name: unknown loss 'counted_grpo'; valid: grpo, cispo"]


def test_an_enabled_package_adds_its_loss_and_estimator(installed, monkeypatch):
    enable(monkeypatch, packages=[EXAMPLE_PACKAGE])
    assert LOSSES.names == (*LOSSES.builtins, "counted_grpo")
    assert ADVANTAGE_ESTIMATORS.names == (*ADVANTAGE_ESTIMATORS.builtins, "centered")
    spec = parse_spec(PLUGIN_SPEC)
    loss = make_loss(spec.loss_fn.name, spec.loss_fn)
    assert type(loss).__module__ == "rlserve_example_plugin.loss"
    estimator = advantage_estimator(spec.grpo.adv_estimator, spec.loss_fn)
    assert type(estimator).__module__ == "rlserve_example_plugin.advantages"
    # A name the package does not add is still refused, with the plug-in's among the valid ones.
    (p,) = problems({"loss_fn": {"name": "ppo"}})
    assert p == "loss_fn.name: unknown loss 'ppo'; valid: grpo, cispo, counted_grpo"


def test_a_plugin_loss_reports_its_own_metric(installed, monkeypatch):
    enable(monkeypatch, packages=[EXAMPLE_PACKAGE])
    loss = make_loss("counted_grpo", parse_spec({}).loss_fn)
    n = 6
    inputs = LossInputs(curr_logprobs=torch.full((n,), -1.0), prev_logprobs=torch.full((n,), -1.0),
                        gen_logprobs=torch.full((n,), -1.0), ref_logprobs=None, advantages=torch.ones(n),
                        mask=torch.ones(n), seq_index=torch.tensor([0, 0, 0, 1, 1, 1]), num_seqs=2)
    _, sums = loss(inputs, float(n))
    metrics = finalize_metrics(sums, loss.reported_sums)
    assert metrics["example_plugin/loss_micro_batches"] == 1.0 and "loss/total" in metrics


def test_the_cluster_file_can_name_entries_by_import_path(monkeypatch):
    monkeypatch.delenv(PLUGINS_ENV, raising=False)
    assert "clipped" not in LOSSES
    enable(monkeypatch, entries={"rlserve.losses": {"clipped": "rlserve.algorithms.losses.cispo:CispoLoss"}})
    assert parse_spec({"loss_fn": {"name": "clipped"}}).loss_fn.name == "clipped"
    assert type(make_loss("clipped", parse_spec({}).loss_fn)).__name__ == "CispoLoss"
    assert TASKS.names == tuple(TASKS.builtins)  # the other registries are untouched


def test_plugins_that_cannot_be_read_fail_loudly(installed, monkeypatch):
    monkeypatch.setenv(PLUGINS_ENV, '{"packages": ["rlserve-no-such-plugin"]}')
    missing = "the cluster file's plugins.packages names 'rlserve-no-such-plugin', which is not installed"
    with pytest.raises(PluginError, match=missing):
        LOSSES.names
    (p,) = problems({"loss_fn": {"name": "grpo"}})
    assert p.startswith(f"loss_fn.name: {missing}")
    monkeypatch.setenv(PLUGINS_ENV, '{"packages": ["rlserve-example-plugin"], '
                                    '"entries": {"rlserve.losses": {"counted_grpo": "m:a"}}}')
    with pytest.raises(PluginError, match="both add 'counted_grpo' to rlserve.losses"):
        LOSSES.names
    monkeypatch.setenv(PLUGINS_ENV, '{"entries": {"rlserve.losses": {"grpo": "m:a"}}}')
    with pytest.raises(PluginError, match="adds the loss 'grpo', which is a built-in's name"):
        LOSSES.names


@pytest.mark.parametrize("section, says", [
    ({"entries": {"rlserve.lossess": {"x": "m:a"}}}, "not a registry's group; valid: rlserve.losses"),
    ({"entries": {"rlserve.losses": {"grpo": "m:a"}}}, "the name of a built-in loss"),
    ({"entries": {"rlserve.losses": {"x": "m.py"}}}, "pattern"),
    ({"packages": ["a", "a"]}, "listed twice"),
    ({"packages": ["a b"]}, "pattern")])
def test_the_cluster_files_plugins_section_is_checked(section, says):
    with pytest.raises(ValidationError, match=says):
        PluginsCfg(**section)


def test_every_open_registry_has_its_own_group():
    assert all(group.startswith("rlserve.") and registry.group == group for group, registry in OPEN_REGISTRIES.items())
    assert PluginsCfg().env() == {}


def test_the_cluster_files_plugins_reach_every_service(tmp_path):
    (tmp_path / "cluster.yaml").write_text(f"plugins: {{packages: [{EXAMPLE_PACKAGE}]}}\n")
    cfg, runs_dir = load_cluster_file(tmp_path / "cluster.yaml")
    for name in APPS:
        deployment = app_args(cfg, name, runs_dir)["deployment"]
        if name != "gateway":  # it validates no spec and builds nothing by name
            assert deployment["env_vars"] == cfg.plugins.env(), name
    assert PluginsCfg.model_validate_json(cfg.plugins.env()[PLUGINS_ENV]).packages == [EXAMPLE_PACKAGE]


def test_the_coordinators_spec_reader_sees_the_enabled_plugins(installed, monkeypatch):
    """The reader is a child process of the coordinator's replica: it inherits the replica's environment."""
    import yaml

    async def read(text: str):
        reader = SpecReader()
        try:
            return await reader.read(text, "alice")
        finally:
            await reader.close()

    text = yaml.safe_dump(PLUGIN_SPEC)
    with pytest.raises(SpecError, match="unknown loss 'counted_grpo'"):
        asyncio.run(read(text))
    enable(monkeypatch, packages=[EXAMPLE_PACKAGE])
    assert asyncio.run(read(text)).loss_fn.name == "counted_grpo"
