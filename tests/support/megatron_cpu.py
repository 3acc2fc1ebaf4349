"""Run Megatron-Core's model path on a CPU-only machine, for tests only.

megatron-core 0.16.1 assumes CUDA on the GPTModel model path (local spec,
`use_cpu_initialization=True`). `megatron_cpu()` patches exactly this, and
restores it on exit:

1. The CUDA RNG tracker (`tensor_parallel/random.py`: `CudaRNGStatesTracker.add`
   and `fork` call `torch.cuda.get_rng_state`): the tracker singleton
   `_CUDA_RNG_STATE_TRACKER` becomes a `CpuRNGStatesTracker` that forks the CPU
   generator. Attention dropout forks it (`transformer/dot_product_attention.py`).
2. `torch.cuda.current_device()` as seen by five modules (their module-level
   `torch` name is swapped for a proxy whose `cuda.current_device()` is "cpu";
   nothing else changes): `utils.py` (`GlobalMemoryBuffer.get_tensor`, the
   attention-score buffer), `models/common/embeddings/rotary_pos_embedding.py`
   (`RotaryEmbedding.get_emb` moves `inv_freq`), `tensor_parallel/mappings.py`
   (the TP/EP all-gather, reduce-scatter and all-to-all output buffers),
   `tensor_parallel/layers.py` (sequence-parallel buffers) and
   `transformer/moe/router.py` (`Router.gating` moves the router weight).
3. `get_default_causal_mask` (`transformer/utils.py`, `device="cuda"`): a CPU
   version, in `transformer.utils` and where it was imported by name
   (`fusions/fused_softmax.py`).
4. The CUDA generator's state that activation recompute saves and restores
   (`tensor_parallel/random.py`: `_get_cuda_rng_state`/`_set_cuda_rng_state`,
   called by `CheckpointFunction`): an empty state that restores nothing (the
   CPU generator and the tracker, which the CPU runs draw from, are saved
   beside it).

(The 0.16.1 MoE router bug without Transformer Engine, `te_general_gemm`
unbound, hits GPUs too; `rlserve.learner.megatron.model.build_gpt_model` works
around it, so it is not patched here.)

These patches never belong in `libs/`: the product path runs on GPUs.

`megatron_cpu_training()` adds the global cuda->cpu shim that the training
stack (DDP grad buffers, the optimizers, the forward/backward schedules,
distributed checkpointing) needs on top of those four patches:

4. `torch.cuda.current_device()` is "cpu" for every caller; streams, events,
   `synchronize`, `empty_cache` and `nvtx` become no-ops (`torch.cuda` is
   replaced by a stand-in whose other attributes are the real module's).
5. A `TorchFunctionMode` maps every device argument that names CUDA
   (`device="cuda"`, `"cuda:N"`, an int, `torch.device("cuda")`) to the CPU,
   makes `Tensor.cuda()` the identity, and answers `Tensor.type()` with the
   CUDA type name (`'torch.cuda.FloatTensor'`), which the Megatron optimizers
   check before they accept a parameter.

The megatron learner backend probes `torch.cuda.current_device()` when it is
built on a CPU device and refuses to start without CUDA; under this shim the
probe succeeds, which is how the distributed tests run it on gloo.

`gloo_process_group()` brings up torch.distributed (gloo on loopback, file rendezvous),
`model_parallel()` megatron's `parallel_state` over it,
`megatron_single_process()` (fixture: `megatron_world_size_1`) both plus the
patches for world size 1, and
`spawn_workers()` runs a function on N processes (torch.multiprocessing
spawn, one rendezvous file) and returns what each rank returned.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode


class CpuRNGStatesTracker:
    """Named RNG states on the CPU generator, the interface of megatron's CudaRNGStatesTracker."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def _no_cuda_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _restore_no_cuda_rng_state(*args: Any, **kwargs: Any) -> None:
    return None


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()


class _CudaOnCpu:
    """`torch.cuda` whose `current_device()` is the CPU; everything else is the real `torch.cuda`."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCpu:
    """`torch` as seen by a patched megatron module: the real one, but with `_CudaOnCpu` as `cuda`."""

    cuda = _CudaOnCpu()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


# Megatron modules that allocate or move tensors to `torch.cuda.current_device()` on the
# model path (forward, and backward with sequence parallel).
_DEVICE_MODULES = (
    "megatron.core.utils",  # GlobalMemoryBuffer.get_tensor: attention-score buffer
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # RotaryEmbedding.get_emb: inv_freq
    "megatron.core.tensor_parallel.mappings",  # _gather_along_{first,last}_dim, _reduce_scatter_*, all-to-all
    "megatron.core.tensor_parallel.layers",  # sequence-parallel all-gather buffers (forward and backward)
    "megatron.core.transformer.moe.router",  # Router.gating: moves the router weight
)

# `get_default_causal_mask` where it is defined and where it was imported by name.
_MASK_MODULES = ("megatron.core.transformer.utils", "megatron.core.fusions.fused_softmax")


@contextlib.contextmanager
def megatron_cpu(seed: int = 1234) -> Iterator[None]:
    """Patch megatron-core's CUDA-only calls on the model path; restore them on exit."""
    import importlib

    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils as tutils

    tracker = CpuRNGStatesTracker()
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 100)
    saved_tracker = (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED)

    device_modules = [importlib.import_module(name) for name in _DEVICE_MODULES]
    mask_users = [importlib.import_module(name) for name in _MASK_MODULES]
    original_mask = tutils.get_default_causal_mask
    if any(m.get_default_causal_mask is not original_mask for m in mask_users):
        raise RuntimeError("get_default_causal_mask is already patched")

    saved_cuda_state = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)
    mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = tracker, True
    mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = _no_cuda_rng_state, _restore_no_cuda_rng_state
    for module in device_modules:
        module.torch = _TorchOnCpu()
    for module in mask_users:
        module.get_default_causal_mask = _cpu_default_causal_mask
    try:
        yield
    finally:
        mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved_tracker
        mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = saved_cuda_state
        for module in device_modules:
            module.torch = torch
        for module in mask_users:
            module.get_default_causal_mask = original_mask


class _NoOp:
    """A callable, context manager and attribute bag that does nothing (CUDA streams, events, nvtx)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _NoOp:
        return self

    def __getattr__(self, name: str) -> _NoOp:
        return self

    def __enter__(self) -> _NoOp:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _CudaShim:
    """`torch.cuda` for the whole process: the current device is the CPU and stream/sync calls do nothing."""

    def __init__(self, real: Any) -> None:
        self._real = real

    @staticmethod
    def current_device() -> str:
        return "cpu"

    Stream = Event = _NoOp
    stream = current_stream = default_stream = set_stream = _NoOp()
    synchronize = empty_cache = _NoOp()
    nvtx = _NoOp()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _is_cuda(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and value.startswith("cuda")


class _CudaToCpuMode(TorchFunctionMode):
    """Every tensor that megatron asks to put on CUDA lands on the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        device = kwargs.get("device")
        if device is not None and (_is_cuda(device) or isinstance(device, int)):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def megatron_cpu_training(seed: int = 1234) -> Iterator[None]:
    """`megatron_cpu()` plus the global cuda->cpu shim for DDP, optimizers, schedules and checkpoints."""
    real_cuda = torch.cuda
    with megatron_cpu(seed):
        torch.cuda = _CudaShim(real_cuda)
        try:
            with _CudaToCpuMode():
                yield
        finally:
            torch.cuda = real_cuda


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def gloo_process_group(rank: int = 0, world_size: int = 1, init_file: str | None = None) -> Iterator[None]:
    """torch.distributed on gloo over loopback, with a file rendezvous: no TCP store listening anywhere
    (a tcp:// store binds every interface and outlives `destroy_process_group`)."""
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process")
    init_file = init_file or tempfile.mktemp(prefix="megatron-cpu-rdzv-")
    with _environ(GLOO_SOCKET_IFNAME="lo"):
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=120))
        try:
            yield
        finally:
            dist.destroy_process_group()


@contextlib.contextmanager
def model_parallel(tp: int = 1, ep: int = 1, etp: int | None = None) -> Iterator[None]:
    """megatron `parallel_state` for TP/EP/ETP sizes over the current process group, destroyed on exit."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        create_gloo_process_groups=False,
    )
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def megatron_single_process(seed: int = 1234) -> Iterator[None]:
    """World size 1: gloo group, parallel_state (all sizes 1) and the CPU patches, torn down on exit."""
    with gloo_process_group(), model_parallel(), megatron_cpu(seed):
        yield


@pytest.fixture
def megatron_world_size_1() -> Iterator[None]:
    """Pytest fixture form of `megatron_single_process()` (import it into the test module)."""
    with megatron_single_process():
        yield


def _spawned(rank: int, fn: Callable[..., Any], world_size: int, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    result_path = Path(out_dir) / f"rank{rank}.pt"
    try:
        with gloo_process_group(rank, world_size, str(Path(out_dir) / "rendezvous")), megatron_cpu():
            result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, result_path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, result_path)
        raise


def spawn_workers(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` spawned processes; return each rank's result.

    Each process has a gloo group (file rendezvous, loopback sockets) and the CPU
    patches; `fn` sets up `model_parallel(...)` itself (several layouts may
    follow one another). `fn` must be a module-level function and return
    something `torch.save` can write.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="megatron-cpu-") as out_dir:
        try:
            mp.spawn(_spawned, args=(fn, world_size, out_dir, args), nprocs=world_size, join=True)
        except Exception as exc:
            errors = []
            for rank in range(world_size):
                path = Path(out_dir) / f"rank{rank}.pt"
                if path.is_file():
                    saved = torch.load(path, weights_only=True)
                    if not saved["ok"]:
                        errors.append(f"rank {rank}:\n{saved['error']}")
            raise RuntimeError("spawned megatron workers failed\n" + "\n".join(errors)) from exc
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=True)["result"] for r in range(world_size)]
