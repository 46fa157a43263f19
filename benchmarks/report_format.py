"""Markdown pieces of the results summary: numbers, tables, and commands with machine paths replaced
(``OUT`` for an output folder, repository-relative paths, ``python``)."""

from __future__ import annotations

import re

_REPO_DIRS = ("launch/", "benchmarks/", "sglang_wgkv/", "evals/", "tests/")


def clean_path(token: str) -> str:
    """A command token with machine paths replaced (see the module docstring)."""

    def one(m: re.Match) -> str:
        path = m.group(0)
        if "SmolLM2-135M-Instruct" in path:
            return "EMBEDDED_MODEL"
        for d in _REPO_DIRS:
            if "/" + d in path:
                return d + path.split("/" + d, 1)[1]
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if re.fullmatch(r"python[0-9.]*", name):
            return "python"
        if re.search(r"/(out|\.device/\d+)(/|$)", path):
            return "OUT/" + name if name not in ("out", "") and not name.isdigit() else "OUT"
        return "<" + name + ">"

    return re.sub(r"(?<![\w.])/(?:[\w.@+-]+/?)+", one, token)


def cmd(text: str) -> str:
    return "`" + clean_path(text) + "`"


def cmds(x, sep: str) -> str:
    """One command or a list of them (a result of several runs), each cleaned, joined by ``sep``."""
    return sep.join(cmd(c) for c in ([x] if isinstance(x, str) else x or []))


def f(x, digits=2, unit_div=1.0) -> str:
    return "" if x is None else f"{x / unit_div:.{digits}f}"


def gb(x) -> str:
    return f(x, 1, 1e9)


def table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out + [""]
