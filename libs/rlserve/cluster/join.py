"""`ray start` (a node joining a head) that keeps the node on loopback.

Ray 2.60 ties two things to one switch: `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`
keeps a 127.0.0.1 address from being rewritten to the machine's external one
(what keeps rlserve's listeners on loopback, see `lifecycle.py`), and it also
makes `ray start --address` refuse to join a node. This entry point runs
`ray start`; when the switch is at 0 in its environment (so every process of
the node, which inherits it, keeps loopback) it lets the join through and
leaves the given addresses as they are, in this process only. It touches two
private names (`ray_constants.ENABLE_RAY_CLUSTER`,
`services.resolve_ip_for_localhost`); Ray is pinned, and the two-node
integration test fails if joining breaks.

    python -m rlserve.cluster.join --address=127.0.0.1:6380 --node-ip-address=127.0.0.1 ...
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    from ray._private import ray_constants, services
    from ray.scripts.scripts import main as ray_main

    if os.environ.get(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR) == "0":  # set by lifecycle for loopback
        ray_constants.ENABLE_RAY_CLUSTER = True
        services.resolve_ip_for_localhost = lambda host: host
    sys.argv = ["ray", "start", *sys.argv[1:]]
    ray_main()


if __name__ == "__main__":
    main()
