"""Shared test set-up: GPU tests are skipped without CUDA; generated models and client records go to
per-session folders; under pytest-xdist (`make test` runs two workers, tests/support/xdist_schedule.py) every
test that needs a Ray cluster runs on one worker, first, and every other module stays whole on one worker."""

from __future__ import annotations

import os
import tempfile

import pytest

# Models that tests generate (preset:tiny, ...) are cached per test session, not in ~/.cache.
os.environ.setdefault("RLSERVE_MODEL_CACHE", tempfile.mkdtemp(prefix="rlserve-test-models-"))
# Credentials records that `deploy/serve up` writes for clients go here, not to ~/.config.
os.environ.setdefault("RLSERVE_CONFIG_DIR", tempfile.mkdtemp(prefix="rlserve-test-config-"))
# Read by Ray when it is imported: keep the test cluster's node address on loopback
# (rlserve.cluster.lifecycle explains why).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def pytest_collection_modifyitems(config, items):
    import torch

    skip = pytest.mark.skip(reason="needs CUDA (GPU-only test)")
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
    # The cluster tests are the longest unit of work: first, so that the other worker works through the rest
    # beside them (`make test` passes --no-loadscope-reorder, which keeps this order).
    items.sort(key=lambda item: "/integration/" not in str(item.fspath))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadscope":
        from tests.support.xdist_schedule import ClusterTestsTogether

        return ClusterTestsTogether(config, log)
    return None


_config = None


def pytest_configure(config):
    global _config
    _config = config


def pytest_runtest_logreport(report):
    """A failure's error, printed when it happens (also when an xdist worker reports it): a CI run cut off by
    its time limit never reaches pytest's summary, and its log must still say why a test failed."""
    terminal = _config.pluginmanager.get_plugin("terminalreporter") if _config is not None else None
    if report.failed and terminal is not None:
        terminal.write_line("")
        terminal.write_line(f"FAILED {report.nodeid} ({report.when}, {report.duration:.0f} s):", red=True)
        for line in report.longreprtext.splitlines()[-25:]:
            terminal.write_line(f"    {line[:300]}")
