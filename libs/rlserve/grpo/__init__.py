"""The GRPO loop of one run, read top to bottom:

    recovery.run_grpo      attempts until the run ends; restores the last checkpoint after lost state
    loop.GrpoAttempt       setup -> producer + trainer under a watchdog -> finish
    producer.Producer      prompts -> generate -> score -> reference -> StepQueue (rollouts.py)
    trainer.Trainer        StepQueue -> filter -> advantages -> train -> weight sync (sync.py)
    staleness.py           the bound on how old a trajectory may be when trained
    checkpoints.py, sft.py, validation.py
    state.py               immutable run inputs, producer state, trainer state
    services.RunServices   the one typed protocol the loop reaches the services through
    admission.py           what SubmitRun checks, and the preflight

The loop never imports Ray or Serve: the coordinator service implements
`RunServices` with Serve handles, unit tests with an in-memory fake.
"""
