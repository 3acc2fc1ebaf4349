"""vLLM's CPU build generating with a LoRA adapter against without: the cost of serving adapters.

One engine per setting (vLLM AsyncLLM, fp32, the `tiny` preset), 64 prompts x 8 samples x 6 tokens
per call, median of 3 calls after a warm-up: no LoRA; LoRA on with an adapter of rank r on every
linear layer of attention and MLP, and the engine's `max_lora_rank` equal to r or above it (vLLM
pads every adapter to max_lora_rank). Prints a table and writes bench-results/rollout_lora.json.

    .venv/bin/python scripts/bench/rollout_lora.py
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.common import record, table  # noqa: E402

SETTINGS = [("no LoRA", 0, 0), ("LoRA", 8, 8), ("LoRA", 16, 16), ("LoRA", 32, 32), ("LoRA", 8, 32), ("LoRA", 32, 64)]
CALLS = 3


def adapter(folder: Path, rank: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlserve.models import resolve_model

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(resolve_model("preset:tiny")),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    model.save_pretrained(folder)
    return folder


async def main() -> None:
    from rlserve.models import resolve_model
    from rlserve.rollout import make_engine
    from rlserve.rollout.interfaces import EngineConfig, SamplingSpec

    base = resolve_model("preset:tiny")
    prompts = [[8, 11, 41, 12, 9, 47]] * 64
    sampling = SamplingSpec(temperature=1.0, max_new_tokens=6, min_new_tokens=6, seed=1)
    tmp = Path(tempfile.mkdtemp())
    rows = []
    for label, rank, max_rank in SETTINGS:
        lora = rank > 0
        engine = make_engine("vllm", EngineConfig(model_path=base, enable_lora=lora, max_lora_rank=max_rank or 8))
        try:
            if lora:
                await engine.load_adapter(adapter(tmp / f"r{rank}-{max_rank}", rank), base, 1, False)
            await engine.generate(prompts, 8, sampling)
            times = []
            for _ in range(CALLS):
                t0 = time.perf_counter()
                await engine.generate(prompts, 8, sampling)
                times.append(time.perf_counter() - t0)
        finally:
            await engine.close()
        rows.append({"setting": label, "rank": rank, "max_lora_rank": max_rank, "call_s": statistics.median(times)})
    for row in rows:
        row["vs_no_lora"] = row["call_s"] / rows[0]["call_s"]
    print(table(rows, ["setting", "rank", "max_lora_rank", "call_s", "vs_no_lora"]))
    print("wrote", record("rollout_lora", rows, {"calls": CALLS, "prompts": 64, "samples": 8, "tokens": 6}))


if __name__ == "__main__":
    asyncio.run(main())
