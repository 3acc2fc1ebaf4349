#!/usr/bin/env bash
# The GPU system on a machine with no package index (the lent H200), as a user would run it:
#   scripts/gpu/h200_run.sh BUNDLE OUT STAGE...
# BUNDLE: a folder made by `deploy/bundle build`; OUT: where logs and results go.
# Stages: install (the bundle into python3's environment; with --target /tmp/site if that fails),
# check, demo (cluster_gpu_one + grpo_addition_gpu), 1b (cluster_gpu_one_1b + grpo_1b_gpu; both print each
# service's GPU memory against its declared gpu_memory_gib: scripts/gpu/cluster_memory.py),
# 1b-megatron (the same on the megatron learner),
# refit (the 1b workload through the weight store, then by the same-GPU handoff: compare_refit.py),
# generation (scripts/bench/generation_gpu.py: the transformers engine's generate, continuous and static paths
# against a standalone generate_batch on one batch; then the 1b system with the fastest path, GEN_STEPS steps),
# bare (the learner alone on the 1b step's batch shape), gputests (pytest tests/gpu),
# soak (scripts/bench/soak.py on the machine's CPU cores; SOAK_ARGS adds to its arguments),
# consistency (scripts/bench/consistency.py: generator-vs-learner logprobs, bf16 and fp32, dense and MoE,
# with and without routing replay),
# lora (full fine-tuning and LoRA through the cluster, LORA_STEPS steps each: examples/grpo_1b_gpu.yaml on
# cluster_gpu_one_1b, examples/grpo_1b_lora_gpu.yaml on cluster_gpu_one_1b_lora; prints step time, the
# learner's time and peak, and each service's GPU memory against its declared gpu_memory_gib:
# scripts/gpu/cluster_memory.py), lora-bare (the learner alone on the same batch: LoRA with 0, 1/16, 1/8 and
# 1/4 of the layers checkpointed against full).
# Each stage logs to OUT/<stage>.log. Where the bundle is over the 64 MiB carry, carry scripts/gpu/pack_site.sh's
# packed site instead (unpacked to /tmp/site) and skip the install stage.
set -uo pipefail
cd "$(dirname "$0")/../.."
bundle=$1 out=$2; shift 2
export RLSERVE_PYTHON=${RLSERVE_PYTHON:-python3} PYTHONUNBUFFERED=1
mkdir -p "$out"
[[ -d /tmp/site ]] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # an earlier --target install

run_cluster() {  # CLUSTER SPEC NAME: up, submit --watch, status, down; OUT/NAME.log and OUT/NAME.tgz
  local cluster=$1 spec=$2 name=$3 t0=$SECONDS run_dir
  nvidia-smi --query-compute-apps=timestamp,pid,process_name,used_memory --format=csv -lms 500 > "$out/$name-gpu.csv" &
  local sampler=$!
  # What each GPU process is (nvidia-smi names some "[No data]": the learner's workers), for cluster_memory.py.
  while sleep 2; do ps -eo pid=,args= | grep -E ' (ray|VLLM)::' ; done > "$out/$name-ps.txt" 2>/dev/null &
  local ps_sampler=$!
  {
    deploy/serve up "$cluster"
    echo "serve up: $((SECONDS - t0))s"
    deploy/serve status "$cluster"
    t0=$SECONDS
    deploy/rlserve submit "$spec" --watch
    echo "submit --watch: $((SECONDS - t0))s"
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
    deploy/serve down "$cluster"
  } > "$out/$name.log" 2>&1
  kill "$sampler" "$ps_sampler"
  tail -25 "$out/$name.log"
  run_dir=$(ls -td runs/*/ 2>/dev/null | head -1)
  # The run's records, not its weights, checkpoints or tokens (a 1b run's folder is gigabytes).
  [[ -n $run_dir ]] && cp "$run_dir/metrics.jsonl" "$out/$name-metrics.jsonl"
  tar czf "$out/$name.tgz" ${run_dir:+"$run_dir"/*.jsonl "$run_dir"/run.json "$run_dir"/spec.yaml} \
      runs/.cluster/*.log 2>/dev/null
}

for stage in "$@"; do
  case $stage in
    install)
      python3 -m pip list --format=freeze > "$out/image_pip.txt" 2>/dev/null
      if ! bash "$bundle/install.sh" python3 > "$out/install.log" 2>&1; then
        echo "bundle: env install failed (see install.log); installing with --target /tmp/site" | tee -a "$out/install.log"
        bash "$bundle/install.sh" --target /tmp/site python3 >> "$out/install.log" 2>&1
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      fi
      tail -3 "$out/install.log";;
    check) deploy/bundle check 2>&1 | tee "$out/check.log";;
    demo) run_cluster examples/cluster_gpu_one.yaml examples/grpo_addition_gpu.yaml demo
      python3 scripts/gpu/cluster_memory.py "$out" demo=examples/cluster_gpu_one.yaml | tee "$out/demo-memory.txt";;
    1b) run_cluster examples/cluster_gpu_one_1b.yaml examples/grpo_1b_gpu.yaml 1b
      python3 scripts/gpu/cluster_memory.py "$out" 1b=examples/cluster_gpu_one_1b.yaml | tee "$out/1b-memory.txt";;
    generation)  # generation_gpu.py (the engine's modes and a standalone generate_batch on the same batch, in one
                 # process), then the 1b system for GEN_STEPS (5) steps with the engine's fastest mode in the rollout args
      PYTHONPATH=libs:.${PYTHONPATH:+:$PYTHONPATH} timeout "${GEN_TIMEOUT:-300}" python3 scripts/bench/generation_gpu.py \
          --preset 1b --repeats 1 --max-num-seqs 128 \
          --modes "${GEN_MODES:-engine-generate,engine-static,engine-compiled,engine-continuous,cb}" > "$out/generation.log" 2>&1
      cp bench-results/generation_gpu.json "$out/" 2>/dev/null; tail -12 "$out/generation.log"
      python3 - "$out" "${GEN_STEPS:-5}" <<'PY'
import json, sys, yaml
out, steps = sys.argv[1], int(sys.argv[2])
rows = [r for r in json.load(open(f"{out}/generation_gpu.json"))["rows"]
        if r["mode"] in ("engine-generate", "engine-continuous", "engine-static", "engine-compiled") and "tokens_per_s" in r]
best = max(rows, key=lambda r: r["tokens_per_s"])["mode"].removeprefix("engine-")
print(f"the 1b system with generation: {best}")
cfg = yaml.safe_load(open("examples/cluster_gpu_one_1b.yaml"))
cfg["services"]["rollout"]["args"]["generation"] = best
yaml.safe_dump(cfg, open(f"{out}/generation-cluster.yaml", "w"))
spec = yaml.safe_load(open("examples/grpo_1b_gpu.yaml"))
spec["grpo"]["max_num_steps"] = steps
yaml.safe_dump(spec, open(f"{out}/generation-spec.yaml", "w"))
PY
      run_cluster "$out/generation-cluster.yaml" "$out/generation-spec.yaml" generation-1b;;
    1b-megatron)
      python3 -c 'import sys, yaml; spec = yaml.safe_load(open("examples/grpo_1b_gpu.yaml")); spec["policy"]["megatron_cfg"] = {"enabled": True}; yaml.safe_dump(spec, open(sys.argv[1], "w"))' "$out/1b-megatron-spec.yaml"
      run_cluster examples/cluster_gpu_one_1b.yaml "$out/1b-megatron-spec.yaml" 1b-megatron;;
    refit)  # the 1b workload for REFIT_STEPS steps twice: weights through the store, then the GPU handoff
      python3 - "$out" "${REFIT_STEPS:-5}" <<'PY'
import sys, yaml
out, steps = sys.argv[1], int(sys.argv[2])
spec = yaml.safe_load(open("examples/grpo_1b_gpu.yaml"))
spec["grpo"]["max_num_steps"] = steps
yaml.safe_dump(spec, open(f"{out}/refit-spec.yaml", "w"))
for how in ("none", "ipc"):
    cfg = yaml.safe_load(open("examples/cluster_gpu_one_1b.yaml"))
    cfg["services"]["rollout"]["args"]["weight_transfer"] = how
    yaml.safe_dump(cfg, open(f"{out}/refit-{how}.yaml", "w"))
PY
      run_cluster "$out/refit-none.yaml" "$out/refit-spec.yaml" refit-store
      run_cluster "$out/refit-ipc.yaml" "$out/refit-spec.yaml" refit-ipc
      python3 scripts/gpu/compare_refit.py "$out/refit-store-metrics.jsonl" "$out/refit-ipc-metrics.jsonl" \
          --out "$out/refit.json" | tee "$out/refit.txt";;
    bare)  # the learner alone on the 1b step's batch shape (128 rows of ~12 + 512 tokens, packed), same call
      python3 scripts/bench/learner_rl_gpu.py --preset 1b --seqs 128 --prompt 12 --max-len 524 \
          --median-completion 2000 --micro-batch 16 --pack-tokens 16384 --runs dtensor:packed --steps 3 \
          --out "$out/bare.json" > "$out/bare.log" 2>&1; tail -8 "$out/bare.log";;
    gputests) PYTHONPATH=libs:.${PYTHONPATH:+:$PYTHONPATH} timeout "${GPUTESTS_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider \
                tests/gpu ${GPUTESTS_ARGS:-} > "$out/gputests.log" 2>&1; tail -15 "$out/gputests.log";;
    soak) PYTHONPATH=libs:.${PYTHONPATH:+:$PYTHONPATH} python3 scripts/bench/soak.py ${SOAK_ARGS:-} \
            > "$out/soak.log" 2>&1; cp bench-results/soak.json "$out/" 2>/dev/null; tail -12 "$out/soak.log";;
    consistency)  # rollout-training consistency: the transformers engine in bf16 and fp32, dense and MoE, with and
                  # without routing replay, against the dtensor learner at the same precision (CONSISTENCY_ARGS adds)
      PYTHONPATH=libs:.${PYTHONPATH:+:$PYTHONPATH} python3 scripts/bench/consistency.py --device cuda \
          --engines transformers --dtypes bfloat16 float32 --models 1b qwen3-moe-gpu --prompts 64 --samples 8 \
          --new-tokens 256 --micro-batch 16 --out h200_consistency ${CONSISTENCY_ARGS:-} > "$out/consistency.log" 2>&1
      cp bench-results/h200_consistency.json "$out/" 2>/dev/null; tail -8 "$out/consistency.log";;
    lora)  # full and LoRA through the cluster, LORA_STEPS (6) sync steps each, then the table
      python3 - "$out" "${LORA_STEPS:-6}" <<'PY'
import sys, yaml
out, steps = sys.argv[1], int(sys.argv[2])
for name, path in (("full", "examples/grpo_1b_gpu.yaml"), ("lora", "examples/grpo_1b_lora_gpu.yaml")):
    spec = yaml.safe_load(open(path))
    spec["grpo"]["max_num_steps"] = steps
    yaml.safe_dump(spec, open(f"{out}/lora-{name}-spec.yaml", "w"))
PY
      run_cluster examples/cluster_gpu_one_1b.yaml "$out/lora-full-spec.yaml" lora-full
      run_cluster examples/cluster_gpu_one_1b_lora.yaml "$out/lora-lora-spec.yaml" lora-lora
      python3 scripts/gpu/cluster_memory.py "$out" lora-full=examples/cluster_gpu_one_1b.yaml \
          lora-lora=examples/cluster_gpu_one_1b_lora.yaml --out "$out/lora.json" | tee "$out/lora.txt";;
    lora-bare)  # the learner alone on the 1b step's batch: full, and LoRA with a share of the layers checkpointed
      python3 scripts/bench/learner_rl_gpu.py --preset 1b --seqs 128 --prompt 12 --max-len 524 \
          --median-completion 2000 --micro-batch 16 --pack-tokens 16384 --lora-rank 32 --steps 3 \
          --runs dtensor:packed dtensor-lora:packed dtensor-lora+ac0.0625:packed dtensor-lora+ac0.125:packed \
          dtensor-lora+ac0.25:packed --out "$out/lora-bare.json" > "$out/lora-bare.log" 2>&1
      python3 - "$out/lora-bare.json" <<'PY' | tee "$out/lora-bare.txt"
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    line = r["error"][:90] if "error" in r else f"{r['step_s']:.3f} s, peak {r['peak_mem_gib']:.1f} GiB"
    if "step_time_vs_full" in r:
        line += f", time {r['step_time_vs_full']:.3f}x and memory {r['peak_mem_vs_full']:.3f}x full's"
    print(f"{r['run']:30} {line}")
PY
      ;;
    *) echo "unknown stage $stage" >&2; exit 2;;
  esac
done
