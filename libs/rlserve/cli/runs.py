"""Client commands over gRPC: `rlserve submit` and `rlserve runs list|get|cancel|watch|usage`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc

from rlserve.clients.coordinator import CoordinatorClient, default_endpoint
from rlserve.runs.consistency import summary as consistency_summary
from rlserve.runs.usage import Usage
from rlserve.v1 import coordinator_pb2 as pb

_STATE = {v: pb.RunState.Name(v).removeprefix("RUN_STATE_").lower() for v in pb.RunState.values()}
_QUIET_KINDS = {pb.EVENT_KIND_STEP, pb.EVENT_KIND_WEIGHT_SYNC}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="submit a run spec to the coordinator")
    p.add_argument("spec", type=Path, nargs="?")
    p.add_argument("--watch", action="store_true", help="follow the run until it ends (exit 1 if it fails)")
    p.add_argument("--run-id", default="")
    p.add_argument("--resume", metavar="RUN_ID", help="continue RUN_ID from its last checkpoint (with SPEC: "
                   "extend it to that spec's grpo.max_num_steps, or sft/dpo.max_num_steps)")
    _connection_args(p)
    p.set_defaults(func=submit)

    runs = sub.add_parser("runs", help="list, inspect, cancel or watch runs, or show what they spent")
    runs.add_argument("action", choices=["list", "get", "cancel", "watch", "usage"])
    runs.add_argument("run_id", nargs="?")
    _connection_args(runs)
    runs.add_argument("-v", "--verbose", action="store_true", help="watch: print every event")
    runs.add_argument("--user", help="usage: only this user's runs (an admin sees every user's; a user, their own)")
    runs.set_defaults(func=runs_cmd)


def _connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", default=None, help=f"the cluster's gRPC endpoint (default {default_endpoint()})")
    p.add_argument("--token-file", type=Path, default=None,
                   help="bearer token file (default: $RLSERVE_TOKEN, $RLSERVE_TOKEN_FILE, or the file "
                        "`deploy/serve up` recorded for the endpoint)")
    p.add_argument("--ca-file", type=Path, default=None, help="certificate to trust for a TLS endpoint")


def _client(args: argparse.Namespace) -> CoordinatorClient | None:
    try:
        return CoordinatorClient(args.endpoint, token_file=args.token_file, ca_file=args.ca_file)
    except (ValueError, OSError) as err:  # an unreadable token or CA file
        print(f"rlserve: {err}", file=sys.stderr)
        return None


def _fail(err: grpc.RpcError) -> int:
    print(f"rlserve: {err.code().name}: {err.details()}", file=sys.stderr)
    return 2


def submit(args: argparse.Namespace) -> int:
    if args.resume:
        # With a spec: extend the run (only its algorithm's max_num_steps may differ from its stored spec).
        spec_yaml, run_id = (args.spec.read_text() if args.spec else ""), args.resume
    else:
        if args.spec is None or not args.spec.is_file():
            print(f"rlserve: give a spec file (got {args.spec})", file=sys.stderr)
            return 2
        spec_yaml, run_id = args.spec.read_text(), args.run_id
    client = _client(args)
    if client is None:
        return 2
    with client:
        try:
            run = client.submit(spec_yaml, run_id=run_id, resume=bool(args.resume))
        except grpc.RpcError as err:
            return _fail(err)
        print(f"run {run.run_id}: {_STATE[run.state]} (run directory {run.run_dir})", flush=True)
        if not args.watch:
            return 0
        return watch(client, run.run_id, verbose=False)


def _describe(run: pb.Run) -> str:
    ledger = run.ledger
    dropped = ", ".join(f"{k}={v}" for k, v in sorted(ledger.dropped.items())) or "none"
    lines = [f"run {run.run_id} ({run.name}): {_STATE[run.state]}, step {run.step}/{run.max_steps}, "
             f"weight version {run.weight_version}",
             f"  ledger: generated {ledger.generated}, scored {ledger.scored}, trained {ledger.trained}, "
             f"dropped {dropped}, in flight {ledger.in_flight}",
             f"  run directory: {run.run_dir}"]
    if run.owner:  # empty from a coordinator older than owners
        lines.append(f"  owner: {run.owner}")
    if run.HasField("usage"):
        lines.append(f"  usage: {_spend(Usage.from_proto(run.usage))}")
    consistency = consistency_summary(dict(run.last_metrics))
    if consistency:
        lines.append(f"  {consistency}")
    if run.error:
        lines.append(f"  error: {run.error}")
    if run.final_model_path:
        lines.append(f"  final model: {run.final_model_path}")
    if run.plot_path:
        lines.append(f"  reward plot: {run.plot_path}")
    return "\n".join(lines)


def _spend(u: Usage) -> str:
    return (f"generated {u.generated_tokens} tokens, trained {u.trained_tokens} tokens, generation "
            f"{u.generation_device_seconds:.1f} device-s, training {u.training_device_seconds:.1f} device-s")


def usage(runs: list[pb.Run], user: str | None) -> str:
    """Each run's spend, then each user's total (the runs the caller may see: an admin's are everyone's)."""
    runs = [r for r in runs if user is None or r.owner == user]
    rows = [("run", "owner", "generated tokens", "trained tokens", "generation device-s", "training device-s")]
    totals: dict[str, Usage] = {}
    for run in sorted(runs, key=lambda r: (r.owner, r.created_unix)):
        u = Usage.from_proto(run.usage)
        totals.setdefault(run.owner, Usage()).add(u)
        rows.append((run.run_id, run.owner, str(u.generated_tokens), str(u.trained_tokens),
                     f"{u.generation_device_seconds:.1f}", f"{u.training_device_seconds:.1f}"))
    for owner, u in sorted(totals.items()):
        rows.append((f"total of {owner or '(no owner)'}", owner, str(u.generated_tokens), str(u.trained_tokens),
                     f"{u.generation_device_seconds:.1f}", f"{u.training_device_seconds:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def watch(client: CoordinatorClient, run_id: str, verbose: bool) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=False)
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn()]
    try:
        with Progress(*columns, console=console, transient=False) as progress:
            run = client.get(run_id)
            task = progress.add_task("GRPO", total=run.max_steps, completed=run.step, info="")
            for ev in client.watch(run_id):
                m = ev.metrics
                if ev.kind == pb.EVENT_KIND_STEP:
                    info = " ".join(f"{label} {m[key]:.3f}" for key, label in (
                        ("reward/mean", "reward"), ("val/reward", "held-out"), ("policy/reference_kl", "kl"),
                        ("timing/step_s", "step_s")) if key in m)
                    progress.update(task, completed=ev.step, info=info)
                if verbose or ev.kind not in _QUIET_KINDS:
                    kind = pb.EventKind.Name(ev.kind).removeprefix("EVENT_KIND_").lower()
                    progress.console.print(f"[dim]step {ev.step:>4}[/dim] {kind:<11} {ev.message}")
        run = client.get(run_id)
    except grpc.RpcError as err:
        return _fail(err)
    print(_describe(run))
    initial, final = run.last_metrics.get("val/reward_initial"), run.last_metrics.get("val/reward")
    if run.state == pb.RUN_STATE_SUCCEEDED and initial is not None and final is not None:
        print(f"held-out reward: before {initial:.2f} after {final:.2f}")
    return 0 if run.state == pb.RUN_STATE_SUCCEEDED else 1


def runs_cmd(args: argparse.Namespace) -> int:
    if args.action not in ("list", "usage") and not args.run_id:
        print(f"rlserve: runs {args.action} needs a RUN_ID", file=sys.stderr)
        return 2
    client = _client(args)
    if client is None:
        return 2
    with client:
        try:
            if args.action == "list":
                for run in client.list():
                    owner = f"  {run.owner}" if run.owner else ""  # a user lists their own runs, an admin everyone's
                    print(f"{run.run_id:<40} {_STATE[run.state]:<10} step {run.step}/{run.max_steps}{owner}")
                return 0
            if args.action == "usage":
                print(usage(client.list(), args.user))
                return 0
            if args.action == "get":
                print(_describe(client.get(args.run_id)))
                return 0
            if args.action == "cancel":
                run = client.cancel(args.run_id)
                print(f"run {run.run_id}: {_STATE[run.state]}")
                return 0
        except grpc.RpcError as err:
            return _fail(err)
        return watch(client, args.run_id, args.verbose)
