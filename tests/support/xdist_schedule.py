"""How `make test` shares the suite between its pytest-xdist workers.

The clusters of tests/integration share one set of ports and the machine's Ray session folder, so one worker
runs all of them, in order; every other module is one unit of work, whole on one worker, so that its module
fixtures (vLLM engines, gloo worlds) start once. (xdist's own `xdist_group` marks cannot say this: pytest 9
ignores the node ids xdist 3.8 rewrites for them.)
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling


class ClusterTestsTogether(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
        return "tests/integration" if nodeid.startswith("tests/integration/") else nodeid.split("::", 1)[0]
