"""The `tinker-cookbook`'s own drivers against the shared test cluster's Tinker API (/api/v1 of the gateway's
HTTP listener): `tinker_cookbook.supervised.train` on a local JSONL chat dataset and `tinker_cookbook.rl.train`
on the cookbook's arithmetic task, a few steps each, on the cluster's deployed model with its tokenizer and
renderer registered in the cookbook's registries (tests/support/tinker_cookbook_drivers.py). The run to
learning is scripts/bench/tinker_cookbook_rl.py."""

from __future__ import annotations

import pytest

from rlserve.models import resolve_model
from rlserve.security.users import add_user
from tests.support.tinker_cookbook_drivers import addition_jsonl, metrics, reinforce, supervised

pytestmark = pytest.mark.integration

BASE = "rlserve/tiny"  # the test cluster's rollout deploys preset:tiny


def test_the_cookbook_drivers_train_on_the_cluster(test_cluster, tmp_path):
    key = add_user(test_cluster.cluster.users_file, "tinkcook", admin=False, tinker=True)
    url, folder = test_cluster.cluster.http_url, resolve_model("preset:tiny")
    data = addition_jsonl(tmp_path / "addition.jsonl", 16)
    sl = metrics(supervised(url, key, BASE, folder, tmp_path / "sl", data, batch_size=8, steps=2, learning_rate=1e-3))
    nll = [m["train_mean_nll"] for m in sl if "train_mean_nll" in m]
    assert len(nll) == 2 and all(0 < x < 10 for x in nll), sl
    rl = metrics(reinforce(url, key, BASE, folder, tmp_path / "rl", batch_size=2, group_size=2, steps=2,
                           learning_rate=1e-3))
    rewards = [m for m in rl if "env/all/reward/total" in m]
    assert len(rewards) == 2, rl
