"""The `calculator` tool: arithmetic on numbers, evaluated from the expression's syntax tree.

No `eval`: the expression is parsed, and only numbers, + - * / // % **, unary
signs and parentheses are evaluated; anything else (a name, a call, an
attribute) is an error the policy reads as its observation. Sizes are bounded
so that no expression can hold the service: the text's length, exponents, and
the digits of any intermediate integer.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_CHARS = 256
MAX_EXPONENT = 64
MAX_DIGITS = 64

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate; the message is the policy's observation."""


def _check(value: int | float) -> int | float:
    if isinstance(value, int) and abs(value) >= 10**MAX_DIGITS:
        raise CalculatorError(f"result has more than {MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    return value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent above {MAX_EXPONENT}")
        try:
            return _check(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
    raise CalculatorError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")


def calculate(expression: str) -> str:
    """The value of `expression` as text (an integer stays exact)."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("give an arithmetic expression")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression.strip()[:64]!r}") from None
    value = _eval(tree)
    return str(int(value)) if isinstance(value, float) and value.is_integer() and abs(value) < 2**53 else str(value)
