"""Mutants of one SQL statement: each condition deleted in turn, and each order comparison
moved by one (``<`` to ``<=`` and back, ``>`` to ``>=`` and back).

A condition is an operand of ``AND`` or ``OR`` wherever one appears (WHERE, ON, CASE WHEN,
a boolean column): both neighbours of every ``AND``/``OR`` are deleted in turn, so every term
of a chain goes once. Comments are stripped first; mutants that read the same are one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"""
    (?P<comment>--[^\n]*)
  | (?P<string>'(?:[^']|'')*')
  | (?P<word>[A-Za-z_][A-Za-z_0-9]*)
  | (?P<op><=|>=|<>|<@|@>|->>|->|=>|::|&&|\|\||[<>(),])
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)

# Where a boolean operand ends (or, looking left, begins) at the same depth.
_BOUNDARY = {
    "and", "or", "then", "else", "end", "as", "when", "where", "on", "having", "select",
    "from", "join", "left", "cross", "inner", "returning", "order", "group", "limit", "for",
    "union", "set", "with", "using", "do", "values", "insert", "update", "delete", ",",
}
_FLIP = {"<": "<=", "<=": "<", ">": ">=", ">=": ">"}


@dataclass(frozen=True)
class Mutant:
    description: str  # what changed, e.g. "drop `AND t.queue = ev.queue`"
    text: str


@dataclass(frozen=True)
class _Tok:
    kind: str
    text: str
    start: int
    end: int
    depth: int


def _tokens(sql: str) -> tuple[str, list[_Tok]]:
    """The statement without comments, and its tokens (whitespace dropped)."""
    clean = _TOKEN.sub(lambda m: " " * len(m.group()) if m.lastgroup == "comment" else m.group(),
                       sql)
    tokens: list[_Tok] = []
    depth = 0  # a parenthesis sits at the depth outside it, what it encloses one deeper
    for m in _TOKEN.finditer(clean):
        kind = m.lastgroup or "other"
        text = m.group()
        if kind == "other" and text.isspace():
            continue
        if text == ")":
            depth -= 1
        tokens.append(_Tok(kind, text, m.start(), m.end(), depth))
        if text == "(":
            depth += 1
    return clean, tokens


def _is_boundary(tokens: list[_Tok], j: int) -> bool:
    """``FROM`` in ``IS [NOT] DISTINCT FROM`` is inside a comparison, not a boundary."""
    word = tokens[j].text.lower()
    if word == "from" and j > 0 and tokens[j - 1].text.lower() == "distinct":
        return False
    return word in _BOUNDARY


def _is_connective(tokens: list[_Tok], i: int) -> bool:
    """A boolean ``AND``/``OR`` (not DDL's ``CREATE OR REPLACE``)."""
    word = tokens[i].text.lower()
    if word == "or" and i + 1 < len(tokens) and tokens[i + 1].text.lower() == "replace":
        return False
    return word in ("and", "or")


def _operand_end(tokens: list[_Tok], i: int) -> int:
    """Index of the last token of the operand that starts after token ``i``."""
    depth = tokens[i].depth
    j = i + 1
    while j < len(tokens):
        tok = tokens[j]
        if tok.depth < depth or (tok.depth == depth and _is_boundary(tokens, j)):
            break
        j += 1
    return j - 1


def _operand_start(tokens: list[_Tok], i: int) -> int:
    """Index of the first token of the operand that ends before token ``i``."""
    depth = tokens[i].depth
    j = i - 1
    while j >= 0:
        tok = tokens[j]
        if tok.depth < depth or (tok.depth == depth and _is_boundary(tokens, j)):
            break
        j -= 1
    return j + 1


def _shown(text: str) -> str:
    short = " ".join(text.split())
    return short if len(short) <= 80 else short[:77] + "..."


def mutants(sql: str, before: str | None = None) -> list[Mutant]:
    """Every mutant of ``sql`` (of its text up to ``before`` when given)."""
    clean, tokens = _tokens(sql)
    if before is not None:
        limit = clean.index(before)
        tokens = [t for t in tokens if t.end <= limit]
    found: dict[str, Mutant] = {}

    def add(description: str, start: int, end: int, replacement: str = "") -> None:
        text = clean[:start] + replacement + clean[end:]
        line = clean.count("\n", 0, start) + 1
        found.setdefault(" ".join(text.split()), Mutant(f"L{line}: {description}", text))

    for i, tok in enumerate(tokens):
        if _is_connective(tokens, i):
            last = _operand_end(tokens, i)
            if last > i:  # drop "AND right"
                add(f"drop `{_shown(clean[tok.start:tokens[last].end])}`",
                    tok.start, tokens[last].end)
            first = _operand_start(tokens, i)
            if first < i:  # drop "left AND"
                add(f"drop `{_shown(clean[tokens[first].start:tok.end])}`",
                    tokens[first].start, tok.end)
        elif tok.text in _FLIP:
            context = _shown(clean[tokens[max(0, i - 2)].start:tokens[min(len(tokens) - 1, i + 2)].end])
            add(f"`{tok.text}` -> `{_FLIP[tok.text]}` in `{context}`", tok.start, tok.end,
                _FLIP[tok.text])
    return list(found.values())
