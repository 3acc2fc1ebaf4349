"""The `rlserve` command: validate specs, make models, submit and watch runs."""

from __future__ import annotations

import argparse
import sys

from rlserve.cli import export, models, runs, spec


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    spec.register(sub)
    models.register(sub)
    runs.register(sub)
    export.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
