"""Fair share of a rollout engine between runs: first come, first served against `FairGeneration`.

Two runs keep a vLLM engine (CPU build, the tiny preset, `max_num_seqs` small
so that they contend) busy with more requests than it runs at once. Case
`lengths`: equal priority, one run's completions 10x longer than the other's.
Case `priority`: equal lengths, priorities 2 and 1. Per mode the table gives
each run's generated tokens per second over the measured window, the ratio
between the runs, and the ratio of the tokens the share charges (prompt tokens
too): fair share aims at 1.0 (lengths) and 2.0 (priority) in charged tokens;
first come, first served gives the long run ~10x (it holds the slots 10x
longer).

    .venv/bin/python scripts/bench/fair_share.py [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from common import record, table

CASES = {"lengths": {"short": (8, 1.0), "long": (80, 1.0)},
         "priority": {"high": (24, 2.0), "low": (24, 1.0)}}


async def _race(engine, mode: str, runs: dict[str, tuple[int, float]], seconds: float, clients: int,
                warmup_s: float) -> dict:
    from rlserve.rollout.fair_generation import FairGeneration
    from rlserve.rollout.interfaces import SamplingSpec

    fair = FairGeneration(engine)
    tokens = {run: 0 for run in runs}
    charged = {run: 0 for run in runs}
    start = time.perf_counter()
    stop = start + warmup_s + seconds

    async def client(run: str, length: int, priority: float, i: int) -> None:
        sampling = SamplingSpec(temperature=1.0, max_new_tokens=length, min_new_tokens=length)
        prompt = [8, 11, 41 + i % 5, 12, 9, 47]
        while time.perf_counter() < stop:
            if mode == "fair":
                out = await fair.generate(run, priority, [prompt], 2, sampling)
            else:
                out = await engine.generate([prompt], 2, sampling)
            if time.perf_counter() > start + warmup_s:
                made = sum(len(s.token_ids) for s in out[0])
                tokens[run] += made
                charged[run] += made + len(prompt)

    await asyncio.gather(*[client(run, length, priority, i) for run, (length, priority) in runs.items()
                           for i in range(clients)])
    elapsed = time.perf_counter() - start - warmup_s
    a, b = runs
    return {"mode": mode, **{f"{run}_tok_s": tokens[run] / elapsed for run in runs},
            "ratio": tokens[a] / max(1, tokens[b]), "charged_ratio": charged[a] / max(1, charged[b])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="measured seconds per mode and case")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--clients", type=int, default=6, help="requests each run keeps open (2 samples each)")
    args = ap.parse_args()

    from rlserve.models import resolve_model
    from rlserve.rollout import make_engine
    from rlserve.rollout.interfaces import EngineConfig

    async def run_all() -> list[dict]:
        engine = make_engine("vllm", EngineConfig(model_path=resolve_model("preset:tiny"), max_model_len=256,
                                                  max_num_seqs=args.max_num_seqs))
        rows = []
        try:
            for case, runs in CASES.items():
                for mode in ("fifo", "fair"):
                    row = {"case": case, **await _race(engine, mode, runs, args.seconds, args.clients,
                                                       args.warmup_s)}
                    print(f"  {row}", flush=True)
                    rows.append(row)
        finally:
            await engine.close()
        return rows

    rows = asyncio.run(run_all())
    for case, runs in CASES.items():
        a, b = runs
        print(f"\ncase {case}: {a} {runs[a]} vs {b} {runs[b]} (completion tokens, priority)")
        print(table([r for r in rows if r["case"] == case], ["mode", f"{a}_tok_s", f"{b}_tok_s", "ratio", "charged_ratio"]))
    print("results:", record("fair_share", rows, vars(args)))


if __name__ == "__main__":
    main()
