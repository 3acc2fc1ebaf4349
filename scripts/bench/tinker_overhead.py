"""Per-call overhead of the Tinker API: `forward_backward`, `optim_step` and `sample` through the endpoint
with the official SDK (HTTP, protobuf, futures) against the same work on the learner's session table and
the engine directly, in one process (an in-process learner group and the transformers engine).

CPU (the tiny chat preset, rank 8):
    .venv/bin/python scripts/bench/tinker_overhead.py
GPU (the lead's run; the 1b preset, LoRA rank 32):
    .venv/bin/python scripts/bench/tinker_overhead.py --model preset:1b --rank 32 --device cuda \
        --datums 8 --tokens 512 --sample-tokens 64 --iters 10
Prints one JSON line: median seconds per call both ways, and the median of each pair's difference (the
overhead) in seconds and in percent of the direct call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="preset:tiny-chat")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--datums", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--sample-tokens", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()

    import tinker
    import torch
    from tinker import types

    from rlserve.gateway.http import HttpConfig, start_http
    from rlserve.learner.in_process_group import InProcessWorkerGroup
    from rlserve.learner.publishing import Publishing
    from rlserve.learner.sessions import SessionTable
    from rlserve.models import resolve_model
    from rlserve.rollout.hf_engine import TransformersEngine
    from rlserve.rollout.interfaces import EngineConfig, SamplingSpec
    from rlserve.security.identity import TokenStore
    from rlserve.security.principal import Role
    from rlserve.security.users import add_user
    from rlserve.tenancy.policy import CallerLimits
    from rlserve.tinker.api import TinkerApi
    from rlserve.tinker.calls import TinkerCalls
    from rlserve.tinker.local import EngineSampler, LocalRuns, TableTrainer
    from rlserve.tinker.service import TinkerConfig, TinkerService
    from rlserve.training.primitives import AdamStep, Datum, DatumBatch

    class NoPublishing(Publishing):
        def publisher(self, backend, store_name, bucket_bytes, timeout_s):
            raise NotImplementedError

        def drop_adapter(self, store_name, run_id):
            pass

    tmp = Path(tempfile.mkdtemp(prefix="tinker-bench-"))
    key = add_user(tmp / "users", "bench", admin=False, tinker=True)
    files = {}
    for role in (Role.USER, Role.ADMIN):
        files[role] = tmp / f"{role.name.lower()}.token"
        files[role].write_text("x" * 40 + role.name + "\n")
        files[role].chmod(0o600)
    model = resolve_model(args.model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    loop = asyncio.new_event_loop()
    ready, state = threading.Event(), {}

    def serve() -> None:
        asyncio.set_event_loop(loop)

        async def start() -> None:
            table = SessionTable(InProcessWorkerGroup.starter(NoPublishing()))
            engine = TransformersEngine(EngineConfig(model_path=model, device=args.device, enable_lora=True))
            cfg = TinkerConfig(bases={"bench": args.model}, train_micro_batch_size=args.datums,
                               max_datum_tokens=args.tokens + 8)
            state["service"] = TinkerService(cfg, tmp / "runs", TableTrainer(table), EngineSampler(engine),
                                             LocalRuns())
            state["table"] = table
            runner = await start_http(HttpConfig("127.0.0.1", 0, TokenStore(files, tmp / "users"), CallerLimits()),
                                      [TinkerApi(TinkerCalls(state["service"]))])
            state["port"] = runner.addresses[0][1]

        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    ready.wait()
    rng = np.random.default_rng(0)
    rows = [rng.integers(3, vocab, args.tokens + 1) for _ in range(args.datums)]
    data = [types.Datum(model_input=types.ModelInput.from_ints(r[:-1].tolist()),
                        loss_fn_inputs={"target_tokens": r[1:].astype(np.int64),
                                        "weights": np.ones(args.tokens, dtype=np.float32)}) for r in rows]
    adam = types.AdamParams(learning_rate=1e-5)
    prompt = rows[0][:32].tolist()

    client = tinker.ServiceClient(base_url=f"http://127.0.0.1:{state['port']}", api_key=key)
    trainer = client.create_lora_training_client(base_model="bench", rank=args.rank).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=args.sample_tokens, temperature=1.0, stop=[], seed=0)  # same length

    run_id = state["service"].models[trainer.model_id].run_id
    batch = DatumBatch([Datum(torch.tensor(r[:-1]), torch.tensor(r[1:]), {"weights": torch.ones(args.tokens)})
                        for r in rows], "cross_entropy", {})
    table = state["table"]
    on_loop = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result()  # noqa: E731
    folder = state["service"].samplers[sampler._sampling_session_id].adapter
    calls = {
        "forward_backward": (lambda: trainer.forward_backward(data, "cross_entropy").result(),
                             lambda: on_loop(table.forward_primitive(run_id, batch, True))),
        "optim_step": (lambda: trainer.optim_step(adam).result(),
                       lambda: on_loop(table.optim_step(run_id, AdamStep(1e-5)))),
        "sample": (lambda: sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result(),
                   lambda: on_loop(state["service"].sampler.sample(
                       run_id, 1.0, folder, prompt, 1, SamplingSpec(max_new_tokens=args.sample_tokens, seed=0))))}

    def seconds(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    result = {"model": args.model, "rank": args.rank, "device": args.device, "datums": args.datums,
              "tokens": args.tokens, "sample_tokens": args.sample_tokens, "iters": args.iters}
    for name, (api, direct) in calls.items():
        api(), direct()  # warm-up
        # Each iteration times both ways back to back, so a machine busy with other work weighs on both alike;
        # the overhead is the median of the pairs' differences.
        pairs = [(seconds(api), seconds(direct)) for _ in range(args.iters)]
        a, d = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        extra = statistics.median(p[0] - p[1] for p in pairs)
        result[name] = {"api_s": round(a, 4), "direct_s": round(d, 4), "overhead_s": round(extra, 4),
                        "overhead_pct": round(100 * extra / d, 1)}
    print(json.dumps(result))
    client.close("success").result()


if __name__ == "__main__":
    main()
