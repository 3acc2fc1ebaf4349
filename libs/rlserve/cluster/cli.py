"""`deploy/serve`: up, down, status, token, users, quotas and swap for an rlserve cluster."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rlserve.config.errors import SpecError


def _cluster(path: Path | None):
    from rlserve.cluster.config import default_cluster_file, load_cluster_file
    from rlserve.cluster.lifecycle import Cluster

    cfg, runs_dir = load_cluster_file(path or default_cluster_file())
    for old, new in cfg.deprecated_keys.items():
        print(f"serve: WARNING: {cfg.source}: `{old}` is deprecated; use `{new}` (the value is read as that)",
              file=sys.stderr, flush=True)
    cluster = Cluster(cfg, runs_dir)
    # Before anything imports Ray: it reads the loopback switch at import time.
    os.environ.update(cluster.env())
    return cluster


def _engine_line(engine: str) -> str:
    """What `engine: auto` chose for the rollout, for the operator."""
    if engine == "vllm":
        return "serve: rollout engine: vllm (services.rollout.args.engine: auto, and vLLM runs on the rollout's device)"
    return (f"serve: rollout engine: {engine}, not vLLM: vLLM is missing on the rollout's node, or has no build for "
            f"its device (services.rollout.args.engine: auto; the rollout replica's log says which). "
            f"`pip install .[gpu]` installs vLLM (docs/gpus.md, \"vLLM on GPUs\")")


def cmd_up(args: argparse.Namespace) -> int:
    from rlserve.cluster.lifecycle import served_engine, up

    cluster = _cluster(args.cluster)
    print(f"serve: starting {cluster.cfg.name} ({'local head on ' + cluster.cfg.host if not cluster.cfg.address else 'at ' + cluster.cfg.address})", flush=True)
    up(cluster)
    if cluster.cfg.services.rollout.args.get("engine") == "auto":
        print(_engine_line(served_engine(cluster)), flush=True)
    tls = " with TLS" if cluster.cfg.tls else ""
    print(f"serve: all services running; gRPC endpoint {cluster.grpc_endpoint}{tls}")
    if cluster.http_url is not None:
        print(f"serve: OpenAI-compatible endpoint {cluster.http_url}/v1 (the same bearer tokens)")
    if cluster.token_files is not None:
        print(f"serve: bearer token in {cluster.token_files[0]} (`rlserve` finds it; "
              f"`deploy/serve token` shows this path again)")
    print(f"serve: runs in {cluster.runs_dir}")
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    cluster = _cluster(args.cluster)
    if cluster.token_files is None:
        print("serve: `auth: none` in this cluster file: the endpoint takes no token", file=sys.stderr)
        return 1
    path = cluster.token_files[1 if args.admin else 0]
    if not path.is_file():
        print(f"serve: {path} does not exist yet; `deploy/serve up` creates it", file=sys.stderr)
        return 1
    print(path)
    return 0


def _users_file(cluster) -> Path:
    if cluster.users_file is None:
        raise ValueError("`auth: none` in this cluster file: the endpoint has no users")
    return cluster.users_file


def cmd_users(args: argparse.Namespace) -> int:
    from rlserve.security.users import add_user, read_users, revoke_user

    cluster = _cluster(args.cluster)
    path = _users_file(cluster)
    if args.action == "add":
        token = add_user(path, args.name, args.admin, tinker=args.tinker)
        print(token)
        print(f"serve: added {args.name} ({'admin' if args.admin else 'user'}) to {path}; this is the only time "
              f"the token is shown. They pass it to rlserve as RLSERVE_TOKEN, or save it in a file of mode 0600 "
              f"and pass `--token-file FILE`.", file=sys.stderr)
    elif args.action == "revoke":
        revoke_user(path, args.name)
        print(f"serve: revoked {args.name}: the endpoint refuses their token within ~1 s; their runs go on "
              f"(`users add {args.name}` gives them a new token and their runs back)", file=sys.stderr)
    else:
        user_file, admin_file = cluster.token_files
        print(f"{'name':<33} {'role':<6} where")
        print(f"{'user':<33} {'user':<6} {user_file} (every token in it)")
        print(f"{'admin':<33} {'admin':<6} {admin_file} (every token in it)")
        for user in read_users(path):
            print(f"{user.principal.name:<33} {user.principal.role.name.lower():<6} {path}")
    return 0


def cmd_quotas(args: argparse.Namespace) -> int:
    from rlserve.security.principal import LEGACY_ADMIN, LEGACY_USER, Principal, Role
    from rlserve.security.users import read_users

    cluster = _cluster(args.cluster)
    policy = cluster.cfg.tenancy
    principals = [Principal(LEGACY_USER, Role.USER), Principal(LEGACY_ADMIN, Role.ADMIN)]
    principals += [u.principal for u in read_users(cluster.users_file)] if cluster.users_file else []
    principals += [Principal(name, Role.USER) for name in policy.users if name not in {p.name for p in principals}]
    print(f"serve: the `tenancy` section of {cluster.cfg.source} (the coordinator re-reads it within ~1 s of an "
          f"edit); every user's runs together: at most {policy.cluster.max_training_runs} train at once "
          f"(tenancy.cluster.max_training_runs), {policy.cluster.queue_capacity} wait to start "
          f"(tenancy.cluster.queue_capacity)", file=sys.stderr)
    print(f"{'name':<33} {'unfinished':>10} {'waiting':>8} {'samples/run':>13} {'priority':>9}")
    for p in principals:
        limits = policy.limits_of(p)
        if limits is None:
            print(f"{p.name:<33} not limited (admin)")
        else:
            q = limits.values
            print(f"{p.name:<33} {q.max_unfinished_runs:>10} {q.max_waiting_runs:>8} {q.max_samples_per_run:>13} "
                  f"{q.max_priority:>9g}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from rlserve.cluster.lifecycle import down

    down(_cluster(args.cluster))
    print("serve: stopped")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from rlserve.cluster.lifecycle import node_status, status

    cluster = _cluster(args.cluster)
    rows = status(cluster)
    print(f"{'app':<12} {'state':<14} {'version':<11} replicas")
    for r in rows:
        replicas = ", ".join(f"{d}={n}" for d, n in r["replicas"].items())
        print(f"{r['app']:<12} {r['state']:<14} {r['version']:<11} {replicas}"
              + (f"  ({r['message']})" if r["message"] else ""))
    nodes = node_status(cluster)
    for name, alive in nodes.items():
        print(f"node {name}: {'alive' if alive else 'down (deploy/serve up starts it again)'}")
    return 0 if all(r["state"] == "RUNNING" for r in rows) and all(nodes.values()) else 1


def cmd_swap(args: argparse.Namespace) -> int:
    from rlserve.cluster.lifecycle import swap_reward

    if args.service != "reward":
        print(f"serve: only the reward service can be swapped, not {args.service!r}", file=sys.stderr)
        return 2
    app = swap_reward(_cluster(args.cluster), args.target)
    functions = app["args"].get("functions") or [{"name": "the reward service's default function"}]
    print("serve: reward now runs " + ", ".join(f.get("import_path") or f["name"] for f in functions))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    import yaml

    from rlserve.cluster.serve_config import serve_config

    cluster = _cluster(args.cluster)
    print(yaml.safe_dump(serve_config(cluster.cfg, cluster.runs_dir), sort_keys=False), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deploy/serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, helptext in (("up", cmd_up, "start Ray (unless `address` is set) and deploy every service"),
                               ("down", cmd_down, "stop the services and the local Ray head"),
                               ("status", cmd_status, "state, version and replicas per application"),
                               ("config", cmd_config, "print the Serve config derived from the cluster file")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("cluster", type=Path, nargs="?", help="cluster file (default: the embedded one)")
        p.set_defaults(func=fn)
    p = sub.add_parser("token", help="print the path of the cluster's token file")
    p.add_argument("cluster", type=Path, nargs="?", help="cluster file (default: the embedded one)")
    p.add_argument("--admin", action="store_true", help="the admin token file (internal services) instead")
    p.set_defaults(func=cmd_token)
    p = sub.add_parser("users", help="named users of the endpoint: add (prints the token once), list, revoke")
    p.add_argument("action", choices=["add", "list", "revoke"])
    p.add_argument("name", nargs="?", help="a short folder-safe word (add, revoke)")
    p.add_argument("--admin", action="store_true", help="add: an admin (every run, the internal services)")
    p.add_argument("--tinker", action="store_true",
                   help="add: a key of the Tinker SDK's form (`tml-...`), for TINKER_API_KEY; rlserve takes it too")
    p.add_argument("-c", "--cluster", type=Path, help="cluster file (default: the embedded one)")
    p.set_defaults(func=cmd_users)
    p = sub.add_parser("quotas", help="each user's quotas (the cluster file's `tenancy` section)")
    p.add_argument("-c", "--cluster", type=Path, help="cluster file (default: the embedded one)")
    p.set_defaults(func=cmd_quotas)
    p = sub.add_parser("swap", help="redeploy one service with new code (only: reward)")
    p.add_argument("service")
    p.add_argument("target", help="module:attr, or path/to/file.py[:attr] (attr defaults to `reward`), or "
                                  "`default`: the functions the cluster file deploys, exactly")
    p.add_argument("-c", "--cluster", type=Path, help="cluster file (default: the embedded one)")
    p.set_defaults(func=cmd_swap)
    args = parser.parse_args(argv)
    if getattr(args, "action", None) in ("add", "revoke") and not args.name:
        parser.error(f"users {args.action} needs a NAME")
    try:
        return args.func(args)
    except (SpecError, ValueError, RuntimeError, TimeoutError) as err:
        print(f"serve: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
