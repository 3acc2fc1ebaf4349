"""Every model call of a run's endpoint, recorded server-side: `<run_dir>/agents/calls.jsonl`.

One JSON line per call, written when its completion is out:

    kind               "call"
    call_id, episode_id, task_id, validation, trains, caller, time
    api                "chat" or "completion"
    continued          the prompt continued an earlier call's tokens (prompt, completion, new messages)
    sequence           which of the episode's training sequences it joined (null: not trained)
    prompt_token_ids   the prompt exactly as the engine took it
    choices            per completion: token_ids, logprobs (under the weights that sampled each token),
                       versions (the weight version of each token), finish_reason, text

and one line per ended episode (`kind: "episode"`: how it ended, its reward, calls and sequences). The
lines are the engine's own token ids and logprobs, never a re-tokenization of text; a crash mid-line
leaves one torn line that readers skip (`runs.recorder.Recorder.read`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rlserve.v1 import agents_pb2, common_pb2

FILE = Path("agents") / "calls.jsonl"


def token_versions(choice: agents_pb2.ChatChoice) -> list[int]:
    """The weight version of each token of a completion."""
    out = [0] * len(choice.token_ids)
    for run in choice.version_runs:
        out[run.start:run.end] = [run.version] * (run.end - run.start)
    return out


class Capture:
    def __init__(self, run_dir: Path):
        self.path = run_dir / FILE
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - held for the session, closed by close()

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def call(self, resp: agents_pb2.ChatResponse, prompt: list[int], *, task_id: str, validation: bool,
             trains: bool, caller: str, api: str, sequence: int | None) -> None:
        self._write({
            "kind": "call", "time": time.time(), "call_id": resp.call_id, "episode_id": resp.episode_id,
            "task_id": task_id, "validation": validation, "trains": trains, "caller": caller, "api": api,
            "continued": resp.continued, "sequence": sequence, "weight_version": resp.weight_version,
            "prompt_token_ids": prompt,
            "choices": [{"token_ids": list(c.token_ids), "logprobs": list(c.logprobs), "versions": token_versions(c),
                         "finish_reason": common_pb2.FinishReason.Name(c.finish_reason).removeprefix(
                             "FINISH_REASON_").lower(), "text": c.text} for c in resp.choices]})

    def episode(self, episode_id: str, task_id: str, how: str, reward: float | None, calls: int, sequences: int,
                detail: str = "") -> None:
        self._write({"kind": "episode", "time": time.time(), "episode_id": episode_id, "task_id": task_id,
                     "ended": how, "reward": reward, "calls": calls, "sequences": sequences, "detail": detail})

    def close(self) -> None:
        self._file.close()


def read(run_dir: Path) -> list[dict[str, Any]]:
    """The capture's records (a torn last line skipped)."""
    path = run_dir / FILE
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows
