"""The run loop, for every algorithm, read top to bottom:

    recovery.run_to_end    attempts until the run ends; restores the last checkpoint after lost state
    attempt.Attempt        setup -> steps (each with its epilogue) -> finish, under a watchdog
    algorithm.Algorithm    what an algorithm says at each step (`rlserve.algorithms`: grpo, distillation,
                           sft, dpo; chosen by name through `rlserve.catalog.ALGORITHMS`)
    learner.py             the one place a run configures its learner session
    checkpoints.py         the typed checkpoint state; save, restore, rewind
    sync.py, validation.py weight sync (the published version), held-out validation
    inputs.py              the run's resolved spec, model, tokenizer and data; the cluster's loop settings
    services.RunServices   the one typed protocol the loop reaches the services through (retry.py)
    admission.py           what SubmitRun checks, and the preflight

An RL algorithm's trajectories come from `rlserve.trajectories` (the producer, the step queue, the
staleness bound). The loop never imports Ray or Serve: the coordinator implements `RunServices` with
Serve handles, unit tests with an in-memory fake.
"""
