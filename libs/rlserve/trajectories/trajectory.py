"""One trajectory type for every rollout: a single-turn sample is an episode of one turn.

A `Trajectory` is everything after its prompt: the policy's turns exactly as the engine generated
them and, in a multi-turn episode, the environment's observations and the template's turn markers
between them (`mask` False, generator logprob 0). A `Group` is the trajectories of one prompt,
which group-relative advantages compare. Nothing here knows whether an environment or a batch
`Score` gave the reward.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

from rlserve.v1 import rollout_pb2

# How an episode ended: the environment (or the one scored turn) said done, the turn limit, or the
# token limits cut it.
ENDINGS = ("done", "max_turns", "truncated")


@dataclass
class Trajectory:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the generator's, per token (0 for context)
    mask: list[bool] = field(default_factory=list)  # the loss counts the token (the policy's own)
    versions: list[tuple[int, int, int]] = field(default_factory=list)  # (version, start, end) in tokens
    reward: float = 0.0
    turns: int = 0
    ending: str = ""
    # The environment's metrics (its last report in the episode) and the reward functions' (per sample).
    env_metrics: dict[str, float] = field(default_factory=dict)
    reward_metrics: dict[str, float] = field(default_factory=dict)
    # (drop reason, message) when the environment failed the episode; the reward plug-in's message when
    # it failed to score it. Either drops the trajectory's whole group.
    failure: tuple[str, str] | None = None
    reward_error: str | None = None
    # The reference policy's logprobs of `tokens`, when the KL term or a teacher needs them.
    ref_logprobs: list[float] | None = None
    # MoE routing replay (policy.routing_replay): the experts the rollout routed each position of prompt +
    # tokens to, from the first position on (the last position has none), as the rollout sends them:
    # base64 of int16 little-endian [positions, layers, experts_per_token], with (layers, experts_per_token).
    routes: str = ""
    route_dims: tuple[int, int] = (0, 0)
    # An external agent's episode (`rlserve.agents`): its own prompt (None: the group's), and where a
    # rewritten history starts another sequence: (offset in `tokens`, that sequence's prompt).
    prompt_ids: list[int] | None = None
    restarts: list[tuple[int, list[int]]] = field(default_factory=list)

    def add(self, ids: list[int], logprobs: list[float] | None, runs=()) -> None:
        """Append a turn (`logprobs` given: the policy's tokens, with the versions that sampled them) or
        context (None: an observation and the template's markers)."""
        start = len(self.tokens)
        self.tokens += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.mask += [logprobs is not None] * len(ids)
        self.versions += [(r.version, start + r.start, start + r.end) for r in runs]

    def add_routes(self, routed: rollout_pb2.RoutedExperts) -> None:
        """A generate call's routing of prompt + sample (every position from the first): the positions not
        covered yet (an earlier turn's call covered the context before this turn's)."""
        dims = (routed.num_layers, routed.experts_per_token)
        if self.route_dims != (0, 0) and self.route_dims != dims:
            raise ValueError(f"routed experts of {dims} (layers, experts per token) after {self.route_dims}")
        row = 2 * dims[0] * dims[1]
        have = base64.b64decode(self.routes)
        self.routes = base64.b64encode(have + routed.expert_ids[len(have) // row * row:]).decode()
        self.route_dims = dims

    def sequences(self, group_prompt: list[int]) -> list[tuple[list[int], int, int]]:
        """(prompt, start, end) of each sequence the learner trains on: its prompt and tokens, or with
        restarts one sequence per stretch of `tokens`, each after its own prompt."""
        starts = [(0, self.prompt_ids if self.prompt_ids is not None else group_prompt), *self.restarts]
        ends = [offset for offset, _ in self.restarts] + [len(self.tokens)]
        return [(prompt, start, end) for (start, prompt), end in zip(starts, ends)]

    @property
    def policy_tokens(self) -> int:
        """The policy's own tokens (the observations between its turns are the environment's)."""
        return sum(self.mask)

    def token_versions(self, default: int) -> list[int]:
        """The weight version that generated each token (`default` for context, which none generated)."""
        out = [default] * len(self.tokens)
        for version, start, end in self.versions:
            out[start:end] = [version] * (end - start)
        return out

    def token_turns(self) -> list[int]:
        """Each token's turn: 1 for the policy's first run of tokens, 2 for its next, ...; 0 for context."""
        out, turn = [], 0
        for k, own in enumerate(self.mask):
            turn += own and (k == 0 or not self.mask[k - 1])
            out.append(turn if own else 0)
        return out

    def version_range(self, default: int) -> tuple[int, int]:
        """(oldest, newest) weight version of its tokens (`default` when none is recorded)."""
        versions = [v for v, _, _ in self.versions] or [default]
        return min(versions), max(versions)

    @classmethod
    def from_dict(cls, saved: dict) -> Trajectory:
        return cls(**{**saved, "versions": [tuple(v) for v in saved["versions"]],
                      "failure": tuple(saved["failure"]) if saved["failure"] else None,
                      "route_dims": tuple(saved.get("route_dims", (0, 0))),
                      "restarts": [tuple(r) for r in saved.get("restarts", [])]})


@dataclass
class Group:
    """The trajectories of one prompt (`num_generations_per_prompt` of them), tagged with the oldest
    weight version any of their tokens was generated under."""

    prompt_index: int  # position of the prompt in the run's data order (the data cursor)
    prompt_ids: list[int]
    trajectories: list[Trajectory]
    weight_version: int
    # Trajectories generated under more than one version (an in-flight update landed while they ran),
    # and the largest newest-minus-oldest version of any of them.
    mixed_samples: int = 0
    version_spread: int = 0

    @classmethod
    def of(cls, prompt_index: int, prompt_ids: list[int], trajectories: list[Trajectory], default: int) -> Group:
        """A group with its versions read off its trajectories (`default`: the version of a trajectory that
        recorded none, e.g. one the environment failed before it generated)."""
        ranges = [t.version_range(default) for t in trajectories]
        return cls(prompt_index, prompt_ids, trajectories, min((lo for lo, _ in ranges), default=default),
                   sum(lo != hi for lo, hi in ranges), max((hi - lo for lo, hi in ranges), default=0))

    @property
    def size(self) -> int:
        return len(self.trajectories)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def generated_tokens(self) -> int:
        return sum(t.policy_tokens for t in self.trajectories)

    @property
    def env_failures(self) -> list[tuple[str, str]]:
        return [t.failure for t in self.trajectories if t.failure is not None]

    @property
    def reward_errors(self) -> list[str]:
        return [t.reward_error for t in self.trajectories if t.reward_error is not None]

    @classmethod
    def from_dict(cls, saved: dict) -> Group:
        """A group as `dataclasses.asdict` saved it in a checkpoint, also in the layout of checkpoints
        written before trajectories had one type (per-sample lists on the group)."""
        if "trajectories" in saved:
            return cls(**{**saved, "trajectories": [Trajectory.from_dict(t) for t in saved["trajectories"]]})
        n = len(saved["completions"])
        masks = saved.get("loss_masks") or [[True] * len(c) for c in saved["completions"]]
        errors = iter(saved.get("reward_errors") or [])
        failures = iter(saved.get("env_failures") or [])
        trajectories = [Trajectory(
            tokens=saved["completions"][j], logprobs=saved["gen_logprobs"][j], mask=masks[j],
            reward=saved["rewards"][j], turns=(saved.get("turns") or [1] * n)[j],
            ending=(saved.get("endings") or ["done"] * n)[j],
            env_metrics=(saved.get("episode_metrics") or [{}] * n)[j],
            ref_logprobs=saved["ref_logprobs"][j] if saved.get("ref_logprobs") else None) for j in range(n)]
        # The old layout kept a failed group's messages, not whose they were: the first trajectories carry them.
        for t in trajectories:
            t.reward_error = next(errors, None)
            failure = next(failures, None)
            t.failure = tuple(failure) if failure else None
        return cls(saved["prompt_index"], saved["prompt_ids"], trajectories, saved["weight_version"],
                   saved.get("mixed_samples", 0), saved.get("version_spread", 0))
