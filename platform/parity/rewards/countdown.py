"""The Countdown checker: does a boxed expression reach the target using each given number exactly once?

The model's text is parsed here, never evaluated by Python or sympy: a small recursive-descent parser over
integers, + - * / and parentheses (LaTeX's \\times, \\cdot and \\div are read as * and /), exact rational
arithmetic, and hard bounds before any work: at most MAX_CHARS characters, MAX_DEPTH nested parentheses,
MAX_DIGITS digits a literal. There is no power operator, so no input can ask for a huge number; a hostile
expression is rejected in time linear in its (bounded) length. It runs in the grader's worker processes
under the same per-item timeout as math-verify (parity.rewards.mathverify)."""

from __future__ import annotations

from fractions import Fraction

ANSWER_PREFIX = "countdown:"  # a reference answer `countdown:3,5,7=22`: the numbers and the target
MAX_CHARS = 256
MAX_DEPTH = 16
MAX_DIGITS = 6
_LATEX = (("\\times", "*"), ("\\cdot", "*"), ("\\div", "/"), ("\\left", ""), ("\\right", ""), ("×", "*"), ("÷", "/"))


def encode_answer(numbers: list[int] | tuple[int, ...], target: int) -> str:
    return f"{ANSWER_PREFIX}{','.join(str(n) for n in numbers)}={target}"


def decode_answer(answer: str) -> tuple[list[int], int]:
    """(numbers, target) of a `countdown:a,b,c=t` reference; ValueError naming the text otherwise."""
    if not answer.startswith(ANSWER_PREFIX):
        raise ValueError(f"not a countdown reference: {answer[:60]!r}")
    body = answer[len(ANSWER_PREFIX):]
    nums, sep, target = body.partition("=")
    try:
        if not sep:
            raise ValueError
        return [int(x) for x in nums.split(",")], int(target)
    except ValueError:
        raise ValueError(f"malformed countdown reference {answer[:60]!r}; expected countdown:3,5,7=22") from None


class CountdownParseError(ValueError):
    pass


class _Parser:
    """expr := term (('+'|'-') term)* ; term := atom (('*'|'/') atom)* ; atom := INT | '(' expr ')'"""

    def __init__(self, text: str) -> None:
        self.s, self.i, self.depth, self.literals = text, 0, 0, []

    def parse(self) -> Fraction:
        v = self.expr()
        if self.i != len(self.s):
            raise CountdownParseError(f"unexpected {self.s[self.i]!r} at {self.i}")
        return v

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def expr(self) -> Fraction:
        v = self.term()
        while self.peek() in ("+", "-"):
            op = self.s[self.i]
            self.i += 1
            w = self.term()
            v = v + w if op == "+" else v - w
        return v

    def term(self) -> Fraction:
        v = self.atom()
        while self.peek() in ("*", "/"):
            op = self.s[self.i]
            self.i += 1
            w = self.atom()
            if op == "/":
                if w == 0:
                    raise CountdownParseError("division by zero")
                v = v / w
            else:
                v = v * w
        return v

    def atom(self) -> Fraction:
        c = self.peek()
        if c == "(":
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise CountdownParseError(f"more than {MAX_DEPTH} nested parentheses")
            self.i += 1
            v = self.expr()
            if self.peek() != ")":
                raise CountdownParseError("unclosed parenthesis")
            self.i += 1
            self.depth -= 1
            return v
        j = self.i
        while j < len(self.s) and self.s[j].isdigit() and self.s[j].isascii():
            j += 1
        if j == self.i:
            raise CountdownParseError(f"expected a number at {self.i}, got {c!r}" if c else "unexpected end")
        if j - self.i > MAX_DIGITS:
            raise CountdownParseError(f"a number longer than {MAX_DIGITS} digits")
        n = int(self.s[self.i:j])
        self.literals.append(n)
        self.i = j
        return Fraction(n)


def normalise(expr: str) -> str:
    """The expression without spaces, LaTeX operators as ASCII, braces as parentheses; of `expr = value` the left
    side (the stated value is not checked: the expression's own value is)."""
    for a, b in _LATEX:
        expr = expr.replace(a, b)
    expr = "".join(expr.split())
    expr = expr.replace("{", "(").replace("}", ")")
    if expr.count("=") == 1:
        expr = expr.split("=")[0]
    return expr


def evaluate(expr: str) -> tuple[Fraction, list[int]]:
    """(value, integer literals in order) of an expression; CountdownParseError when it is not one."""
    if len(expr) > MAX_CHARS:
        raise CountdownParseError(f"longer than {MAX_CHARS} characters")
    text = normalise(expr)
    if not text:
        raise CountdownParseError("empty expression")
    p = _Parser(text)
    return p.parse(), p.literals


def check(expr: str, numbers: list[int], target: int) -> tuple[bool, str]:
    """(correct, status): status is correct | wrong (parses, but misses the target or the numbers) |
    unparsable | too_long."""
    if len(expr) > MAX_CHARS:
        return False, "too_long"
    try:
        value, literals = evaluate(expr)
    except CountdownParseError:
        return False, "unparsable"
    ok = sorted(literals) == sorted(numbers) and value == target
    return ok, "correct" if ok else "wrong"
