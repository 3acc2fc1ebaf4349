"""Synthetic tasks with verifiable answers, generated from a seed.

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
    is the same for every row, so an SFT warm start on the answers learns to guess a number in range
    (uniformly), and only the environment's feedback can do better. Validation plays each distinct game
    (target) once; training samples games of the same kind (a game has no held-out form but its target)."""

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
        return Example(f"guess my number from 1 to {n}.", str(target), {}, None, {"target": target, "max_number": n})


TASKS: dict[str, type[Task]] = {t.name: t for t in (Addition, Multiplication, Countdown, Reverse, Sort, GuessNumber)}


def get_task(name: str, raw_args: dict[str, Any]) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid: {', '.join(TASKS)}")
    cls = TASKS[name]
    return cls(cls.parse_args(raw_args))
