"""Training losses over flat token vectors, one module each, chosen by name (`rlserve.algorithms.registry`).

Layout. The learner gathers a micro-batch's completion tokens into 1-D vectors
of N tokens, whatever its padded or packed layout: `mask` marks the tokens that
count and `seq_index` (0..num_seqs-1) names each token's sequence, so
per-sequence sums are one `index_add`, never a Python loop.

Normalisation. Each micro-batch divides by a *global* normaliser: the valid
tokens (token-level loss) or the sequences (sequence-level loss) of the whole
optimizer step, over all micro-batches and data-parallel ranks. Summing the
micro-batch losses, and summing gradients over ranks (the backend's average
times dp_size), then gives exactly the full-batch loss and gradient, however
the batch was split (NeMo-RL's global_valid_toks / global_valid_seqs). A
sequence must lie whole in one micro-batch.

Metrics. A loss returns, beside its value, a dict of 0-d metric sums that
combine across micro-batches and ranks without a host sync
(`rlserve.algorithms.metrics`). The loss terms `loss_sum`, `pg_loss_sum` and
`kl_loss_sum` are each micro-batch's share of the step objective (already
divided by the global normaliser), so their sum is the step's value; every
other `_sum` / `_count` is a raw sum over valid tokens.

`components` holds the pieces (ratio, clipping, importance weight, KL,
aggregation); `grpo` and `sft` compose them.
"""
