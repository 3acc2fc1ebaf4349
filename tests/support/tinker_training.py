"""Tinker SDK training clients stepped at once from threads, as two users' loops would run them."""

from __future__ import annotations

import threading

from tinker import types


def train_at_once(trainers: dict[str, object], data: list[types.Datum], learning_rate: float, steps: int = 3,
                  timeout_s: float = 300) -> dict[str, list[float]]:
    """Each trainer's cross-entropy `loss:sum` per step, `steps` forward_backward + optim_step each, all at once."""
    losses: dict[str, list[float]] = {name: [] for name in trainers}

    def train(name: str, trainer) -> None:  # noqa: ANN001 - a tinker TrainingClient
        for _ in range(steps):
            fwd = trainer.forward_backward(data, "cross_entropy")
            trainer.optim_step(types.AdamParams(learning_rate=learning_rate)).result()
            losses[name].append(fwd.result().metrics["loss:sum"])

    threads = [threading.Thread(target=train, args=item) for item in trainers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return losses
