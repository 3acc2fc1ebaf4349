"""Tenancy: who may use how much of a shared cluster (fair share of the engines and the learner)."""
