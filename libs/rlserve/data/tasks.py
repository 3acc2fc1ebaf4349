"""Synthetic tasks with verifiable answers, generated from a seed, chosen by `data.task` (the catalog's
`TASKS` names them; a plug-in task is a `Task` subclass too).

Each task turns a seeded RNG into (prompt, answer, metadata) examples. The
prompts use only the character tokenizer's alphabet, and the answers are what
the `exact_match` reward (or, for countdown, the `countdown` reward) checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import operator
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rlserve.catalog import TASKS
from rlserve.environments.tools.calls import FORMATS, ToolCall, call_text, observation


@dataclass(frozen=True)
class Example:
    # The prompt text (for a chat row: its last user message, which reward functions see).
    prompt: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)
    # A chat row's conversation ({"role", "content"} each), rendered by the chat template.
    messages: tuple[dict[str, str], ...] | None = None
    # Per-row arguments for a multi-turn environment (`rlserve.environments.interfaces.Episode`).
    env_args: dict[str, Any] = field(default_factory=dict)
    # An episode played by a demonstrator: after the prompt, the policy's turns and the environment's
    # observations, ending with the policy's last turn. The SFT warm start trains on its assistant turns
    # instead of the answer, so a policy can learn to act on observations (or to call a tool) before GRPO.
    demonstration: tuple[dict[str, str], ...] | None = None


class Task:
    """A named generator of examples with typed arguments (`Args`)."""

    name: ClassVar[str]
    # Training never sees a validation example. A task whose examples are few games of the same
    # prompt (guess_number) validates on its distinct games and trains on games of the same kind.
    held_out: ClassVar[bool] = True

    @dataclass(frozen=True)
    class Args:
        pass

    def __init__(self, args: Any):
        self.args = args

    @classmethod
    def parse_args(cls, raw: dict[str, Any]) -> Any:
        """Build `Args` from the spec's `data.task_args`, with messages that name the key."""
        fields = {f.name: f for f in dataclasses.fields(cls.Args)}
        for key in raw:
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"{key}: unknown key for task {cls.name!r}{hint} "
                                 f"(allowed: {', '.join(fields) or 'none'})")
        for key, value in raw.items():
            want = type(getattr(cls.Args(), key))
            if want is int and (isinstance(value, bool) or not isinstance(value, int)) or \
                    want is bool and not isinstance(value, bool):
                raise ValueError(f"{key}: must be {want.__name__}, got {value!r}")
        args = cls.Args(**raw)
        cls.check_args(args)
        return args

    @classmethod
    def check_args(cls, args: Any) -> None:
        pass

    def example(self, rng: random.Random) -> Example:
        raise NotImplementedError


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


class _Arithmetic(Task):
    """`a OP b=` -> the result zero-padded to a fixed width and, by default, written reversed
    (least significant digit first, which a small model learns far faster)."""

    symbol: ClassVar[str]
    max_digits: ClassVar[int]

    @dataclass(frozen=True)
    class Args:
        digits: int = 2
        reverse_answer: bool = True

    @classmethod
    def check_args(cls, args: Any) -> None:
        if not 1 <= args.digits <= cls.max_digits:
            raise ValueError(f"digits: must be in 1..{cls.max_digits}, got {args.digits}")

    @staticmethod
    def apply(a: int, b: int) -> int:
        raise NotImplementedError

    @staticmethod
    def width(digits: int) -> int:
        raise NotImplementedError

    def example(self, rng: random.Random) -> Example:
        a, b = _number(rng, self.args.digits), _number(rng, self.args.digits)
        answer = str(self.apply(a, b)).zfill(self.width(self.args.digits))
        if self.args.reverse_answer:
            answer = answer[::-1]
        return Example(f"{a}{self.symbol}{b}=", answer, {"a": a, "b": b})


class Addition(_Arithmetic):
    """`47+85=` -> `231` (132 reversed)."""

    name, symbol, max_digits = "addition", "+", 9
    apply = staticmethod(operator.add)
    width = staticmethod(lambda digits: digits + 1)


class Multiplication(_Arithmetic):
    """`12*34=` -> `8040` (0408 reversed)."""

    name, symbol, max_digits = "multiplication", "*", 6
    apply = staticmethod(operator.mul)
    width = staticmethod(lambda digits: 2 * digits)


class Countdown(Task):
    """`3,5,7>22=` -> an expression over the numbers, each used once, equal to
    the target. The stored answer is one solution; the `countdown` reward
    accepts any."""

    name = "countdown"

    @dataclass(frozen=True)
    class Args:
        num_numbers: int = 3
        max_number: int = 9

    @classmethod
    def check_args(cls, args: Any) -> None:
        if not 2 <= args.num_numbers <= 5:
            raise ValueError(f"num_numbers: must be in 2..5, got {args.num_numbers}")
        if not 2 <= args.max_number <= 99:
            raise ValueError(f"max_number: must be in 2..99, got {args.max_number}")

    def example(self, rng: random.Random) -> Example:
        numbers = [rng.randint(1, self.args.max_number) for _ in range(self.args.num_numbers)]
        order = numbers[:]
        rng.shuffle(order)
        expr = str(order[0])
        for n in order[1:]:
            expr += rng.choice("+-*") + str(n)
        target = eval(expr)  # noqa: S307 - digits and +-* only, built just above
        prompt = ",".join(map(str, numbers)) + f">{target}="
        return Example(prompt, expr, {"numbers": numbers, "target": target})


class Reverse(Task):
    name = "reverse"

    @dataclass(frozen=True)
    class Args:
        min_length: int = 3
        max_length: int = 6

    @classmethod
    def check_args(cls, args: Any) -> None:
        if not 1 <= args.min_length <= args.max_length <= 32:
            raise ValueError(f"need 1 <= min_length <= max_length <= 32, got {args.min_length}, {args.max_length}")

    def example(self, rng: random.Random) -> Example:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                       for _ in range(rng.randint(self.args.min_length, self.args.max_length)))
        return Example(f"rev:{word}=", word[::-1])


class Sort(Reverse):
    name = "sort"

    def example(self, rng: random.Random) -> Example:
        word = super().example(rng).answer
        return Example(f"sort:{word}=", "".join(sorted(word)))


class GuessNumber(Task):
    """`guess my number from 1 to N.` for the `guess_number` environment, which holds the number
    (`env_args.target`, also the answer) and answers each guess with "higher" or "lower". The prompt
    is the same for every row, so an SFT warm start on the answers alone learns to guess a number in
    range (uniformly) whatever it hears. The demonstration plays the game with uniform guesses within
    the range the answers so far leave open: it uses the feedback but is no binary search, so SFT on it
    gives a policy that GRPO can make shorter (and, within a turn limit, more often right). Validation
    plays each distinct game (target) once; training samples games of the same kind (a game has no
    held-out form but its target)."""

    name = "guess_number"
    held_out = False

    @dataclass(frozen=True)
    class Args:
        max_number: int = 100

    @classmethod
    def check_args(cls, args: Any) -> None:
        if not 2 <= args.max_number <= 1_000_000:
            raise ValueError(f"max_number: must be in 2..1000000, got {args.max_number}")

    def example(self, rng: random.Random) -> Example:
        n = self.args.max_number
        target = rng.randint(1, n)
        # The demonstrator draws from its own stream, seeded by the data's: the games stay those drawn
        # before there were demonstrations (a tuple of ints hashes the same in every process).
        demonstrator = random.Random(hash(rng.getstate()[1]))
        low, high, played = 1, n, []
        while True:
            guess = demonstrator.randint(low, high)
            played.append({"role": "assistant", "content": str(guess)})
            if guess == target:
                break
            low, high = (guess + 1, high) if guess < target else (low, guess - 1)
            played.append({"role": "user", "content": "higher" if guess < target else "lower"})
        return Example(f"guess my number from 1 to {n}.", str(target), {}, None, {"target": target, "max_number": n},
                       tuple(played))


class ToolMultiplication(Task):
    """`123*45=` -> `5535` for the `tool_use` environment with the `calculator` tool: a product too long
    for a small model to work out, easy to copy from the tool's answer. The demonstration (`use_tool`)
    calls the calculator in `tool_format`, reads its answer and repeats it, which teaches a model that
    was never shown a tool call to spell one; without `use_tool` SFT trains on the answer alone (the
    same task without the tool, for comparison). The answer is written plainly, as the tool gives it."""

    name = "tool_multiplication"

    @dataclass(frozen=True)
    class Args:
        digits: int = 3
        other_digits: int = 2
        use_tool: bool = True
        tool_format: str = "hermes"

    @classmethod
    def check_args(cls, args: Any) -> None:
        for key in ("digits", "other_digits"):
            if not 1 <= getattr(args, key) <= 9:
                raise ValueError(f"{key}: must be in 1..9, got {getattr(args, key)}")
        if args.tool_format not in FORMATS:
            raise ValueError(f"tool_format: one of {', '.join(FORMATS)}, got {args.tool_format!r}")

    def example(self, rng: random.Random) -> Example:
        a, b = _number(rng, self.args.digits), _number(rng, self.args.other_digits)
        answer = str(a * b)
        played = None
        if self.args.use_tool:
            call = ToolCall("calculator", {"expression": f"{a}*{b}"})
            played = ({"role": "assistant", "content": call_text(call, self.args.tool_format)},
                      *observation([answer], self.args.tool_format), {"role": "assistant", "content": answer})
        return Example(f"{a}*{b}=", answer, {"a": a, "b": b}, demonstration=played)


def get_task(name: str, raw_args: dict[str, Any]) -> Task:
    """The task registered as `name` (`rlserve.catalog.TASKS`: these and the cluster's enabled plug-ins) with
    its `Args` from `raw_args`; ValueError listing the valid names if unknown."""
    cls = TASKS.load(name)
    return cls(cls.parse_args(raw_args))
