"""What rlserve adds to each vLLM worker process (vLLM's `worker_extension_cls`).

vLLM builds its workers in its own engine process, so anything rlserve needs
there must arrive by import: naming this class as the engine's
`worker_extension_cls` imports this module in every worker before the model
loads, which registers the `gloo` weight-transfer engine with vLLM's factory
(the worker creates its transfer engine right after loading the model).
"""

from __future__ import annotations

from rlserve.rollout import vllm_reload
from rlserve.weights import gloo_transfer

gloo_transfer.register()


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
