"""Client commands over gRPC: submit, and runs list|get|cancel|watch (filled in by the coordinator work)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    del sub
