"""Check that this interpreter runs every rlserve service: imports, versions, Ray's binaries, the GPU.

`deploy/bundle check` (or `python -m rlserve.bundle check`) prints one line per item and exits 1
if anything a service needs is missing. It imports only; it starts nothing.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

# Module -> what needs it. Each is imported; a failure names the package to bring.
MODULES = {
    "ray": "the cluster", "ray.serve": "every service", "grpc": "gRPC (the gateway, the clients)",
    "grpc_health.v1.health": "the gateway's health service", "grpc_reflection.v1alpha.reflection": "reflection",
    "google.protobuf": "the contracts", "pydantic": "configs", "yaml": "cluster files and specs",
    "torch": "learner, rollout, reference", "transformers": "models", "safetensors": "weights",
    "tokenizers": "tokenizers", "peft": "LoRA runs", "msgpack": "Ray", "aiohttp": "Ray's agents",
    "rlserve.v1.coordinator_pb2_grpc": "the generated stubs (check the grpcio/protobuf versions)",
    "services.gateway.app": "the gateway app", "services.coordinator.app": "the coordinator app",
    "services.rollout.app": "the rollout app", "services.reference.app": "the reference app",
    "services.learner.app": "the learner app", "services.reward.app": "the reward app",
}
# Needed by one feature only: reported, not fatal.
OPTIONAL = {"megatron.core": "the megatron learner backend", "math_verify": "the math_verify reward",
            "vllm": "the vllm rollout engine (else: engine transformers)",
            "tensorboard": "TensorBoard metrics", "rich": "`rlserve submit --watch` progress bar",
            "matplotlib": "the reward plot", "pyarrow": "parquet data files"}
MIN_VERSIONS = {"grpc": (1, 85, 1), "google.protobuf": (7, 35, 0)}


def _version(module) -> str:
    return str(getattr(module, "__version__", "") or "")


def _tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def check() -> int:
    bad = 0
    print(f"python {sys.version.split()[0]} at {sys.executable}")
    for name, why in {**MODULES, **OPTIONAL}.items():
        optional = name in OPTIONAL
        try:
            module = importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - any import failure is the finding
            bad += not optional
            print(f"{'missing' if not optional else 'absent '} {name:<38} {why}: {type(err).__name__}: "
                  f"{str(err).splitlines()[0][:160] if str(err) else ''}")
            continue
        version = _version(module)
        floor = MIN_VERSIONS.get(name)
        if floor and _tuple(version) < floor:
            bad += 1
            print(f"old     {name:<38} {version} < {'.'.join(map(str, floor))} ({why})")
        else:
            print(f"ok      {name:<38} {version}")
    try:
        import ray

        core = Path(ray.__file__).parent / "core" / "src" / "ray"
        for binary in (core / "raylet" / "raylet", core / "gcs" / "gcs_server"):
            ok = binary.is_file() and os.access(binary, os.X_OK)
            bad += not ok
            print(f"{'ok     ' if ok else 'missing'} {str(binary.relative_to(core.parents[2])):<38} "
                  f"{'executable' if ok else 'absent or not executable (unpacked without its exec bits?)'}")
        cli = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "--version"], capture_output=True,
                             text=True, timeout=120)
        bad += cli.returncode != 0
        print(f"{'ok     ' if cli.returncode == 0 else 'broken '} {'python -m ray.scripts.scripts':<38} "
              f"{(cli.stdout or cli.stderr).strip().splitlines()[-1] if (cli.stdout or cli.stderr) else ''}")
    except ImportError:
        pass
    try:
        import torch

        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        print(f"info    torch {torch.__version__}, CUDA {torch.version.cuda}: {len(gpus)} GPU(s) {gpus}")
    except ImportError:
        pass
    print("bundle check: " + ("everything the services need imports" if not bad else f"{bad} problem(s)"))
    return 1 if bad else 0
