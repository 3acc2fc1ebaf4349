"""The helper process of the `math_verify` reward (see rlserve.rewards.math_answers).

Reads one JSON object per line, `{"gold", "completion"}`, and answers with
`{"correct", "extracted"}`. It runs math-verify in its main thread, where the
package's own parse and compare time limits work.
"""

from __future__ import annotations

import json
import sys

from math_verify import parse, verify


def check(gold: str, completion: str) -> dict:
    # A bare LaTeX reference (\frac{1}{2}) parses once wrapped in math delimiters.
    target = parse(gold) or parse(f"${gold}$")
    answer = parse(completion)
    return {"correct": bool(target and answer and verify(target, answer)),
            "extracted": str(answer[-1]) if answer else None}


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        try:
            verdict = check(request["gold"], request["completion"])
        except Exception as err:  # noqa: BLE001 - reported to the caller as this item's error
            verdict = {"error": f"{type(err).__name__}: {err}"[:300]}
        print(json.dumps(verdict), flush=True)


if __name__ == "__main__":
    main()
