"""Supervised run types through the same learner, checkpoints, export and run API as GRPO:

    loop.SupervisedAttempt   an `algorithm: sft` or `algorithm: dpo` run: setup -> steps -> finish
    batches.py               examples -> TrainBatch: SFT on the assistant's tokens; DPO pairs with
                             the reference service's logprobs (the SFT warm start uses it too)
"""
