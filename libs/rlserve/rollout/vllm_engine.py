"""vLLM as a rollout engine: `AsyncLLM`, many requests at once, weights replaced while they run.

The engine runs in vLLM's own processes (AsyncLLM always starts its engine
core as a child process), so weights reach it either through vLLM's
weight-transfer API straight from the learner (`init_weight_transfer`,
`start_weight_update`, `update_weights`, `finish_weight_update`; the `gloo`
engine on CPU, `nccl`/`ipc` on GPUs) or as a folder of safetensors
(`load_weights*`; tensors from the weight store are written to /dev/shm first).

Every update follows vLLM's own sequence: pause generation, load, stamp the
version (`finish_weight_update(weight_version=...)` / `update_weight_version`),
reset the prefix cache, resume. With `in_flight` the pause keeps the running
requests (`mode="keep"`) and the cache reset preempts them, so they recompute
their KV cache under the new weights and continue: every token after the
switch is exactly the new policy's. Without it the pause waits for running
requests to finish first (`mode="wait"`), so a sample never spans versions.
vLLM labels each sample's tokens with the versions that produced them
(`CompletionOutput.weight_versions`); those labels become `version_runs`.

Logprobs are vLLM's `raw_logprobs`: the model's own temperature-1 distribution over the whole
vocabulary, before temperature, top-p and top-k, which is what the learner computes (never the
sampler's renormalised `processed_logprobs`). With `routed_experts` (GPUs: vLLM's routed-experts
capture needs its Model Runner V2) every sample carries the experts of every position, for routing
replay in the learner; vLLM's CPU backend has no capture.

Only one update runs at a time (`_updating`): a direct transfer holds it from
`start_weight_update` until `finish`/`abort`.

Loading in place goes through `rlserve.rollout.vllm_reload` inside the worker
(vLLM's reload plus the re-packing its CPU backend misses for MoE experts and
tied output layers), for the weight store's path and the direct one alike.
A quantised model on CPU has layers whose in-place reload is not known to be
correct: the engine then rebuilds itself on each new set of weights instead
(an engine start per update, never wrong; logged once) and takes weights from
the weight store only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from rlserve.cpu_affinity import children_on
from rlserve.logs import event
from rlserve.rollout.activity import Activity
from rlserve.rollout.interfaces import (
    EngineConfig,
    EngineInfo,
    EngineStats,
    GeneratedSample,
    InvalidRequest,
    RolloutEngine,
    RunAdapter,
    SamplingSpec,
    VersionRun,
)

log = logging.getLogger(__name__)

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
# Transfer engines that receive into staging buffers and touch the model only at
# finish_weight_update (generation may go on while they receive); the others load as they
# receive, so the engine must be paused from start_weight_update on.
_STAGED_TRANSFER = {"gloo"}
_WORKER_EXTENSION = "rlserve.rollout.vllm_worker.RlserveWorkerExtension"
# The one LoRA adapter served at a time (a run's), replaced in place by every new version.
_ADAPTER_NAME = "rlserve-adapter"
# Where weights from the weight store are written for the engine process to read (memory-backed).
_SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None


def _omp_bind(cores: tuple[int, ...], workers: int) -> str:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND: `cores` split evenly over the workers, "0,1|2,3"."""
    per_worker = len(cores) // workers
    if per_worker < 1:
        raise ValueError(f"cpu_cores: {len(cores)} cores for {workers} workers (tensor_parallel_size)")
    return "|".join(",".join(map(str, cores[r * per_worker:(r + 1) * per_worker])) for r in range(workers))


def _version_of(label: str) -> int:
    """vLLM's weight-version label as rlserve's integer version ("default": the deployed weights, 0)."""
    return 0 if label == "default" else int(label)


class VllmEngine(RolloutEngine):
    name = "vllm"

    def __init__(self, cfg: EngineConfig):
        if cfg.torch_threads:
            raise ValueError("torch_threads: the transformers engine's; vLLM's CPU threads follow cpu_cores")
        # Read by vLLM at import and engine start: the AsyncLLM needs its engine-core process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gb))
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("DO_NOT_TRACK", "1")
        self.cfg = cfg
        self.transfer_backend = None if cfg.weight_transfer == "none" else cfg.weight_transfer
        self.num_transfer_workers = cfg.tensor_parallel_size
        self.max_running_sequences = cfg.max_num_seqs
        cpu = not torch.cuda.is_available()
        self.routing_unavailable = "" if cfg.routed_experts else (
            "vLLM's routed-experts capture needs its Model Runner V2, on GPUs only: serve the run on the "
            "transformers engine" if cpu else "started without routed_experts in the rollout's args")
        if cfg.routed_experts and cpu:
            raise ValueError(f"routed_experts: {self.routing_unavailable}")
        self.llm = self._start(cfg.model_path)
        self._tokenizer = self.llm.get_tokenizer()
        self._vocab_size = self.llm.model_config.get_vocab_size()
        quantization = self.llm.model_config.quantization
        self.reload_mode = "rebuild" if cfg.weight_reload == "rebuild" or (cpu and quantization) else "in_place"
        self._rebuilt_from: Path | None = None  # the folder of the weights a rebuilt engine runs
        if self.reload_mode == "rebuild":
            self.transfer_backend = None  # a direct transfer loads in place
            event(log, "rollout.vllm_reload_by_rebuild", logging.WARNING, model=str(cfg.model_path),
                  reason=f"{quantization} quantisation on CPU" if quantization and cpu
                  else "engine config weight_reload=rebuild")
        self._version = 0
        self._activity = Activity()
        self._updating = asyncio.Lock()
        self._paused = False
        self._serving = asyncio.Event()  # cleared while a rebuild replaces the engine
        self._serving.set()
        # The adapter served on the base model (LoRA runs), and the folders of it vLLM may still read.
        self._lora = None
        self._adapter_folders: list[Path] = []
        # The base model the engine's weights are (adapters apply to it): the deployed one, a run's own
        # (its SFT warm start), or None after a full-weight update (a run's trained weights).
        self._base: Path | None = Path(cfg.model_path).resolve()

    def _start(self, model: Path):
        cores = () if torch.cuda.is_available() else self.cfg.cpu_cores
        if cores:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _omp_bind(cores, self.cfg.tensor_parallel_size)
        with children_on(cores, "cpu_cores"):  # the engine process, and the workers it starts
            return self._start_engine(model)

    def _start_engine(self, model: Path):
        from vllm.config import WeightTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        cfg = self.cfg
        # On the CPU backend a prompt split over two scheduler steps (chunked prefill: a batch of
        # prompts beyond the 4096-token step budget) fails every seeded request of the step
        # (vllm-cpu 0.32 rewinds the sampler's generator, which CPU generators cannot do); whole
        # prompts per step avoid it.
        cpu_scheduling = {} if torch.cuda.is_available() else {
            "enable_chunked_prefill": False, "max_num_batched_tokens": max(cfg.max_model_len, 4096)}
        return AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=str(model),
            tokenizer=str(cfg.model_path),
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            seed=cfg.seed,
            tensor_parallel_size=cfg.tensor_parallel_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager,
            max_num_seqs=cfg.max_num_seqs,
            # One worker: inside the engine-core process (no third process, no IPC hop per step).
            distributed_executor_backend="uni" if cfg.tensor_parallel_size == 1 else None,
            **cpu_scheduling,
            worker_extension_cls=_WORKER_EXTENSION,
            # vLLM's own stat loggers are unused (the engine reports `Activity`); computing them costs
            # the replica per-step work for every request.
            disable_log_stats=True,
            # The full vocabulary's temperature-1 logprobs whatever top-p/top-k cut: the learner's distribution.
            logprobs_mode="raw_logprobs",
            **({"enable_return_routed_experts": True} if cfg.routed_experts else {}),
            weight_transfer_config=WeightTransferConfig(backend=self.transfer_backend) if self.transfer_backend else None,
            **({"enable_lora": True, "max_loras": cfg.max_loras, "max_lora_rank": cfg.max_lora_rank}
               if cfg.enable_lora else {}),
        ))

    @property
    def version(self) -> int:
        return self._version

    # --- generation ------------------------------------------------------------------

    async def generate(self, prompts: list[list[int]], n: int, sampling: SamplingSpec,
                       adapter: RunAdapter | None = None) -> list[list[GeneratedSample]]:
        from vllm.exceptions import VLLMClientError
        from vllm.lora.request import LoRARequest

        lora = self._lora
        if adapter is not None:
            await self._deployed_base()
            # vLLM loads the adapter from its folder when it does not hold it (first use, or evicted
            # from its max_loras slots and CPU cache) and batches requests of several adapters together.
            lora = LoRARequest(f"{adapter.run_id}@{adapter.version}", adapter.adapter_id, str(adapter.folder))
        try:
            return list(await asyncio.gather(*(self._generate_one(ids, n, sampling, i, lora, adapter)
                                               for i, ids in enumerate(prompts))))
        except (VLLMClientError, ValueError) as err:  # vLLM's checks of the request (ValueError in older paths)
            raise InvalidRequest(str(err)) from None

    async def _deployed_base(self) -> None:
        """Runs' adapters apply to the deployed model: restore it if a run's own weights serve (a full-parameter
        run's, or an exclusive adapter on a run's own base)."""
        if not self.cfg.enable_lora:
            raise ValueError("this rollout serves without LoRA (enable_lora in its args)")
        await self.use_deployed_base()

    async def use_deployed_base(self) -> None:
        deployed = Path(self.cfg.model_path).resolve()
        if self._base == deployed and self._lora is None:
            return
        async with self._updating:
            if self._base == deployed and self._lora is None:
                return
            await self._pause(in_flight=False)
            try:
                if self._base != deployed:
                    await self.llm.collective_rpc("rlserve_reload_weights", kwargs={"weights_path": str(deployed)})
                self._base, self._lora = deployed, None
                await self.llm.update_weight_version("0")
                await self._switched(0, in_flight=False)
            finally:
                await self._resume()

    async def drop_adapter(self, adapter_id: int) -> None:
        await self.llm.remove_lora(adapter_id)

    async def _generate_one(self, ids: list[int], n: int, sampling: SamplingSpec, index: int, lora,
                            adapter: RunAdapter | None) -> list[GeneratedSample]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k or 0,
            max_tokens=sampling.max_new_tokens,
            min_tokens=sampling.min_new_tokens,
            stop=list(sampling.stop_strings) or None,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            # Distinct seeds per prompt: equal prompts in one call must not sample alike.
            seed=None if sampling.seed is None else sampling.seed + index,
            logprobs=sampling.top_logprobs,
            prompt_logprobs=sampling.prompt_logprobs,
            output_kind=RequestOutputKind.FINAL_ONLY,
            # Incremental detokenisation costs the replica a tokenizer call per token and step; without
            # stop strings one decode of the finished sample (`_sample`) gives the same text.
            detokenize=bool(sampling.stop_strings),
        )
        final = None
        await self._serving.wait()
        self._activity.request_started()
        try:
            # Cached prefixes are keyed by the weights that computed them: a kept KV cache
            # (`in_flight_kv_cache: keep`) never serves a later request old weights' blocks.
            salt = f"weights-{self._version}" if adapter is None else f"adapter-{adapter.adapter_id}"
            prompt = {"prompt_token_ids": ids, "cache_salt": salt}
            async for out in self.llm.generate(prompt, params, request_id=uuid.uuid4().hex, lora_request=lora):
                final = out
        finally:
            self._activity.request_finished(sum(len(o.token_ids) for o in final.outputs) if final else 0)
        samples = [self._sample(o, params.detokenize, adapter, len(ids) if sampling.routed_experts else None)
                   for o in final.outputs]
        if sampling.top_logprobs:
            samples = [replace(s, top_logprobs=tuple(_top(step, sampling.top_logprobs) for step in o.logprobs or []))
                       for s, o in zip(samples, final.outputs)]
        if sampling.prompt_logprobs is not None:
            # vLLM's first entry is None (nothing precedes the first token); each other holds the prompt's own
            # token and the most likely ones, as raw logprobs (`logprobs_mode`).
            rows = final.prompt_logprobs[1:]
            picked = tuple(row[tok].logprob for tok, row in zip(ids[1:], rows))
            top = tuple(_top(row, sampling.prompt_logprobs) for row in rows) if sampling.prompt_logprobs else None
            samples = [replace(s, prompt_logprobs=picked, prompt_top_logprobs=top) for s in samples]
        return samples

    def _sample(self, o, detokenized: bool, adapter: RunAdapter | None, prompt_len: int | None) -> GeneratedSample:
        ids = list(o.token_ids)
        logprobs = [step[tok].logprob for tok, step in zip(ids, o.logprobs or [])]
        if adapter is not None:  # a run's adapter version is fixed for its requests (vLLM's label is the base's)
            runs = (VersionRun(adapter.version, 0, len(ids)),)
        else:
            runs = tuple(VersionRun(_version_of(s.version), s.start, s.end) for s in o.weight_versions or []) or \
                (VersionRun(self._version, 0, len(ids)),)
        text = o.text if detokenized else self._tokenizer.decode(ids, skip_special_tokens=True)
        routes = None
        if prompt_len is not None:
            if o.routed_experts is None:
                raise RuntimeError("vLLM returned no routed experts (is the model a mixture of experts?)")
            # [positions, layers, k] of prompt + sample; the last token's (if vLLM reports one) is not needed.
            routes = torch.from_numpy(np.asarray(o.routed_experts).astype(np.int16))[:prompt_len + len(ids) - 1]
        return GeneratedSample(ids, logprobs, _FINISH.get(o.finish_reason, "stop"), text, runs, routes)

    # --- weight updates ----------------------------------------------------------------

    async def _pause(self, in_flight: bool) -> None:
        if not self._paused:
            await self.llm.pause_generation(mode="keep" if in_flight else "wait", clear_cache=False)
            self._paused = True
            self._activity.paused()

    async def _resume(self) -> None:
        if self._paused:
            await self.llm.resume_generation()
            self._paused = False
            self._activity.resumed()

    async def _switched(self, version: int, in_flight: bool) -> None:
        """After new weights are in: requests in flight recompute under them (unless the KV cache is
        kept); cached prefixes go."""
        self._version = version
        keep = in_flight and self.cfg.in_flight_kv_cache == "keep"
        reset = await self.llm.reset_prefix_cache(reset_running_requests=in_flight and not keep)
        # A kept cache cannot be reset while running requests hold blocks; the version in every
        # request's cache salt already keeps later requests off them.
        if not reset and not keep:
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")

    async def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]], version: int, in_flight: bool) -> None:
        folder = Path(tempfile.mkdtemp(prefix="rlserve-weights-", dir=_SHM))
        try:
            await asyncio.to_thread(save_file, {n: t.contiguous() for n, t in named_tensors},
                                    str(folder / "model.safetensors"), {"format": "pt"})
            await self.load_weights_from_path(folder, version, in_flight)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    async def load_weights_from_path(self, path: Path, version: int, in_flight: bool) -> None:
        if self.reload_mode == "rebuild":
            await self._rebuild(Path(path), version)
            return
        async with self._updating:
            await self._pause(in_flight)
            try:
                await self.llm.collective_rpc("rlserve_reload_weights", kwargs={"weights_path": str(path)})
                self._full_weights_loaded()
                await self.llm.update_weight_version(str(version))
                await self._switched(version, in_flight)
            finally:
                await self._resume()

    def _full_weights_loaded(self) -> None:
        """A run's full weights replaced the base: no adapter applies on them."""
        self._base, self._lora = None, None

    async def load_adapter(self, folder: Path, base: Path, version: int, in_flight: bool) -> None:
        """The adapter replaces the one served, in place (one LoRA slot, reloaded): the same sequence as a
        weight update (pause, load, stamp the version, reset the prefix cache, resume), so a sample's
        tokens are labelled with the adapter versions that produced them."""
        from vllm.lora.request import LoRARequest

        if not self.cfg.enable_lora:
            raise ValueError("this rollout serves without LoRA (enable_lora in its args)")
        if self.reload_mode == "rebuild":
            raise ValueError("this rollout rebuilds its engine for every update; it serves no LoRA adapters")
        async with self._updating:
            await self._pause(in_flight)
            try:
                if self._base != base.resolve():  # other weights serve now (another run's): the base first
                    await self.llm.collective_rpc("rlserve_reload_weights", kwargs={"weights_path": str(base)})
                    self._base = base.resolve()
                request = LoRARequest(_ADAPTER_NAME, 1, str(folder), load_inplace=True)
                if not await self.llm.add_lora(request):
                    raise RuntimeError(f"vLLM did not load the adapter in {folder}")
                self._lora = LoRARequest(_ADAPTER_NAME, 1, str(folder))
                await self.llm.update_weight_version(str(version))
                await self._switched(version, in_flight)
            finally:
                await self._resume()
        # vLLM reads a request's adapter folder again only if it evicted the adapter; keep the served one.
        self._adapter_folders.append(folder)
        while len(self._adapter_folders) > 2:
            shutil.rmtree(self._adapter_folders.pop(0), ignore_errors=True)

    async def _rebuild(self, weights: Path, version: int) -> None:
        """Replace the engine by one started on `weights`; running requests finish on the old one first,
        new ones wait for the new one."""
        folder = Path(tempfile.mkdtemp(prefix="rlserve-vllm-weights-"))
        for f in Path(self.cfg.model_path).iterdir():  # the served model's config and tokenizer files
            if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".safetensors.index.json")):
                shutil.copy(f, folder / f.name)
        for f in weights.iterdir():
            if f.name.endswith((".safetensors", ".safetensors.index.json")):
                shutil.copy(f, folder / f.name)
        async with self._updating:
            self._serving.clear()
            try:
                await self._pause(in_flight=False)
                self.llm.shutdown()
                self.llm = await asyncio.to_thread(self._start, folder)
                await self.llm.update_weight_version(str(version))
                self._version = version
            finally:
                if self._paused:  # the new engine starts unpaused
                    self._paused = False
                    self._activity.resumed()
                self._serving.set()
        if self._rebuilt_from is not None:
            shutil.rmtree(self._rebuilt_from, ignore_errors=True)
        self._rebuilt_from = folder

    async def init_weight_transfer(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if self.transfer_backend is None:
            raise NotImplementedError(f"this vLLM engine takes weights from the weight store only "
                                      f"(reload mode {self.reload_mode}, weight_transfer {self.cfg.weight_transfer})")
        async with self._updating:
            await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    async def start_weight_update(self, in_flight: bool) -> None:
        await self._updating.acquire()
        try:
            if self.transfer_backend not in _STAGED_TRANSFER:
                await self._pause(in_flight)
            await self.llm.start_weight_update()
        except BaseException:
            await self._resume()
            self._updating.release()
            raise

    async def update_weights(self, update_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    async def finish_weight_update(self, version: int, in_flight: bool) -> None:
        try:
            await self._pause(in_flight)
            try:
                await self.llm.finish_weight_update(weight_version=str(version))
            except BaseException:
                await self.llm.collective_rpc("rlserve_abort_weight_update")
                raise
            self._full_weights_loaded()
            await self._switched(version, in_flight)
        finally:
            await self._resume()
            self._updating.release()

    async def abort_weight_update(self) -> None:
        """End a direct update that will not finish (its sender or link is gone); old weights stay."""
        try:
            await self.llm.collective_rpc("rlserve_abort_weight_update")
        finally:
            await self._resume()
            if self._updating.locked():
                self._updating.release()

    # --- the rest ------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return self._activity.stats()

    def info(self) -> EngineInfo:
        return EngineInfo("vllm", str(self.cfg.model_path), self.cfg.max_model_len, self._vocab_size, self.cfg.dtype,
                          extra={"weight_reload": self.reload_mode})

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    async def close(self) -> None:
        self.llm.shutdown()
        for folder in self._adapter_folders:
            shutil.rmtree(folder, ignore_errors=True)
        if self._rebuilt_from is not None:
            shutil.rmtree(self._rebuilt_from, ignore_errors=True)


def _top(step: dict, k: int) -> tuple[tuple[int, float], ...]:
    """The `k` most likely (token, logprob) of one position of vLLM's logprobs (which also holds the chosen
    token, whatever its rank), most likely first."""
    ranked = sorted(((lp.rank, tok, lp.logprob) for tok, lp in step.items() if lp.rank is not None and lp.rank <= k))
    return tuple((tok, logprob) for _, tok, logprob in ranked[:k])
