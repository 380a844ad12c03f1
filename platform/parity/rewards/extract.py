"""Final-answer extraction: the content of the last \\boxed{...} (or \\fbox{...}) of a text.

Pure string scanning, linear in the length of the text: it runs on every sampled response, and a
response may be megabytes of braces, so there is no regex backtracking and no recursion.
"""

from __future__ import annotations

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _last_command(text: str) -> tuple[int, int] | None:
    """(start, end) of the last box command in `text` that is not the prefix of a longer macro
    name (\\boxedfoo is not a box); None if there is none."""
    best: tuple[int, int] | None = None
    for cmd in _BOX_COMMANDS:
        end_limit = len(text)
        while True:
            i = text.rfind(cmd, 0, end_limit)
            if i < 0:
                break
            j = i + len(cmd)
            if j >= len(text) or not text[j].isalpha():
                if best is None or i > best[0]:
                    best = (i, j)
                break
            # Why step back by one: the match at i is a longer macro, an earlier one may be a box.
            end_limit = i + len(cmd) - 1
    return best


def _braced_group(text: str, open_pos: int) -> str | None:
    """Content of the brace group opening at text[open_pos] == '{', or None if it never closes.
    A backslash escapes the next character, so \\{ and \\} are literal braces (as in LaTeX)."""
    depth = 0
    i = open_pos
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[open_pos + 1 : i]
        i += 1
    return None


def _unbraced_argument(text: str, pos: int) -> str | None:
    """`\\boxed 42` form (TeX's single-token argument after a space): the run up to '$' or whitespace."""
    end = pos
    n = len(text)
    while end < n and text[end] not in "$ \t\r\n":
        end += 1
    arg = text[pos:end]
    return arg or None


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} in `text`, brace-matched; None when the text
    has no box or its last box is never closed (a truncated response)."""
    if not text:
        return None
    found = _last_command(text)
    if found is None:
        return None
    _, j = found
    n = len(text)
    k = j
    while k < n and text[k] in " \t":
        k += 1
    if k < n and text[k] == "{":
        return _braced_group(text, k)
    if k > j and k < n:
        return _unbraced_argument(text, k)
    return None
