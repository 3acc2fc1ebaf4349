"""What rlserve adds to each vLLM worker process (vLLM's `worker_extension_cls`).

vLLM builds its workers in its own engine process, so anything rlserve needs
there must arrive by import: naming this class as the engine's
`worker_extension_cls` imports this module in every worker before the model
loads, which registers the receiving side of the `gloo` weight-transfer engine
with vLLM's factory (the worker creates its transfer engine right after
loading the model), its loads made consistent by `vllm_reload`, and patches the CPU build's LoRA
logits for prompt logprobs (`vllm_lora_logits`).

The import also ties vLLM's processes to the rollout replica's life. The
engine core is a child of the replica, the worker a child of the engine core,
and neither notices when the replica is SIGKILLed (a lost node, an OOM kill,
`ray stop --force`): both would go on holding the model and its KV cache with
nobody to serve. A daemon thread in the worker watches the first ancestor that
is not a vLLM process (the replica) and, once it is gone, kills the vLLM
processes between them and then itself.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time

from rlserve.rollout import vllm_lora_logits, vllm_reload
from rlserve.weights import gloo_transfer

REPLICA_POLL_S = 1.0


def _die_with_replica() -> None:
    if multiprocessing.parent_process() is None:  # not a process vLLM started (the replica, a test)
        return
    import psutil

    vllm_ancestors, owner = [], psutil.Process(os.getppid())
    while owner.name().startswith("VLLM::") and owner.ppid() > 1:
        vllm_ancestors.append(owner)
        owner = psutil.Process(owner.ppid())

    def alive() -> bool:
        try:
            return owner.is_running() and owner.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def watch() -> None:
        while alive():
            time.sleep(REPLICA_POLL_S)
        for proc in vllm_ancestors:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="rlserve-replica-watch", daemon=True).start()


class GlooReceiver(gloo_transfer.GlooWeightTransferEngine):
    """The gloo engine's receiving side, reloading with the CPU repacking vLLM's reload misses."""

    def reload_guard(self) -> contextlib.AbstractContextManager:
        return vllm_reload.consistent_reload(self.model)


gloo_transfer.register_receiver(GlooReceiver)
vllm_lora_logits.install()
_die_with_replica()


class RlserveWorkerExtension:
    """Methods mixed into vLLM's worker; the engine calls them through `collective_rpc` by name."""

    def rlserve_reload_weights(self, weights_path: str) -> None:
        """vLLM's reload from a folder, with the CPU repacking it misses (`vllm_reload`)."""
        vllm_reload.reload_in_place(self, weights_path)

    def rlserve_abort_weight_update(self) -> None:
        """End a weight update that cannot finish (a lost sender or link): the model was not touched."""
        engine = self.weight_transfer_engine
        if engine is not None:
            getattr(engine, "abort", lambda: None)()
            engine.reset_weight_update_target()
        self._weight_update_active = False
