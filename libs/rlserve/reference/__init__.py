"""Per-token logprobs of the frozen reference policy (for the KL term)."""
