"""The offline bundle: what an air-gapped node needs beside its own Python stack to run rlserve.

`deploy/bundle build` (on a connected machine), `install.sh` inside the bundle (on the node, no
package index), `deploy/bundle check` (on the node: every service's imports). See docs/operations.md,
"Offline install".
"""
