"""Built-in reward functions for the synthetic tasks. The catalog (`rlserve.catalog.REWARD_FUNCTIONS`) names
them with the others: for math answers (`math_verify`, in math_answers.py) and model-backed ones, a reward
model (`reward_model`, reward_model.py) and a generative judge (`llm_judge`, judge.py)."""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from fractions import Fraction

import regex

from rlserve.rewards.interfaces import RewardFunction, RewardInput, RewardOutput


class ExactMatch(RewardFunction):
    """1 when the completion (stripped) equals the reference answer; optional per-character partial credit."""

    name = "exact_match"

    def __init__(self, partial_credit: bool = False, strip: bool = True):
        self.partial_credit = partial_credit
        self.strip = strip

    def __call__(self, item: RewardInput) -> RewardOutput:
        got, want = (item.completion.strip(), item.answer.strip()) if self.strip else (item.completion, item.answer)
        if got == want:
            return RewardOutput(1.0, {"correct": True})
        if not self.partial_credit or not want:
            return RewardOutput(0.0, {"correct": False})
        same = sum(a == b for a, b in zip(got, want))
        return RewardOutput(0.5 * same / max(len(want), len(got)), {"correct": False})


class FormatReward(RewardFunction):
    """1 when the completion matches a regular expression (full match after stripping).

    The pattern comes from a request, so it is matched with a time limit (the `regex` package):
    a pattern that backtracks catastrophically makes that item an error instead of a hung replica.
    """

    name = "format"
    max_pattern_chars = 1000
    timeout_s = 0.5

    def __init__(self, pattern: str = r"\d+"):
        if len(pattern) > self.max_pattern_chars:
            raise ValueError(f"pattern: longer than {self.max_pattern_chars} characters")
        try:
            self.pattern = regex.compile(pattern)
        except regex.error as err:
            raise ValueError(f"pattern: not a regular expression: {err}") from None

    def __call__(self, item: RewardInput) -> RewardOutput:
        return RewardOutput(float(bool(self.pattern.fullmatch(item.completion.strip(), timeout=self.timeout_s))))


class LengthPenalty(RewardFunction):
    """-(excess characters beyond `max_chars`) * `per_char`, capped at -`cap`."""

    name = "length_penalty"

    def __init__(self, max_chars: int = 64, per_char: float = 0.01, cap: float = 1.0):
        self.max_chars, self.per_char, self.cap = max_chars, per_char, cap

    def __call__(self, item: RewardInput) -> RewardOutput:
        excess = max(0, len(item.completion) - self.max_chars)
        return RewardOutput(-min(self.cap, excess * self.per_char), {"excess_chars": excess})


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _eval_arith(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval_arith(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval_arith(node.left), _eval_arith(node.right))
    raise ValueError("only integers and + - * / are allowed")


class Countdown(RewardFunction):
    """1 when the completion is an expression that uses each given number once and equals the target."""

    name = "countdown"

    def __call__(self, item: RewardInput) -> RewardOutput:
        expr = item.completion.strip()
        numbers, target = item.metadata.get("numbers"), item.metadata.get("target")
        if numbers is None or target is None or not re.fullmatch(r"[\d+\-*/() ]+", expr or "x"):
            return RewardOutput(0.0, {"valid": False})
        used = Counter(int(n) for n in re.findall(r"\d+", expr))
        if used != Counter(int(n) for n in numbers):
            return RewardOutput(0.0, {"valid": False, "reason": "numbers"})
        try:
            value = _eval_arith(ast.parse(expr, mode="eval"))
        except (SyntaxError, ValueError, ZeroDivisionError):
            return RewardOutput(0.0, {"valid": False, "reason": "syntax"})
        return RewardOutput(float(value == target), {"valid": True})
