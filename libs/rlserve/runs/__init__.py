"""Runs as the API sees them: the record of each run (`record`), where its trajectories went
(`ledger`), its run directory (`recorder`), and the manager that queues, starts, cancels and
reloads them (`manager`). The loop that a run executes lives in `rlserve.loop`."""
