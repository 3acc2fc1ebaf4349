"""Trajectories of RL runs, from prompts to the trainer:

    trajectory.py   the one Trajectory type (a single-turn sample is an episode of one turn) and Group
    rollout.play    the one producer of groups: single_turn.py (one Generate, one batch Score),
                    episodes.py (multi-turn, an environment's Step per turn) or external.py (episodes
                    agent programs play through the OpenAI-compatible endpoint); reference logprobs
    generation.py   what a rollout request is made of: plays, sampling, the Generate call
    producer.py     a run's steps of groups, as soon as the staleness bound allows (streaming, DAPO's
                    dynamic sampling)
    queue.py        the step queue between producer and trainer, and the version clock they share
    staleness.py    the bound on how old a trajectory may be when trained
    batch.py        groups -> the estimator's inputs and the learner's TrainBatch
    metrics.py, timings.py
"""
