"""An answer aimed one folder up: the near miss a cleanup answer must not make. An answer that frees space by removing
`~/.cache/mozilla/firefox/x/cache2` differs from one that wipes `~/.cache/mozilla` or the home by a path alone; a
model that learnt only the passing answers has never been shown the difference. Each widened variant here is the
same code with one path it names replaced by an ancestor (a string path's parent folder, a `Path / "part"` chain
without its last part, `os.path.join` without its last argument), nearest first. attempts.py runs them through the
checker on the run's host and logs the nearest that deletes what must be kept, beside the answer it came from, so
the next round's pairs hold that contrast (a `broke` rejected answer, read by --broke_weight's term). The checker
decides what a variant did; nothing here guesses it.

Pure functions on source text (no model, no sandbox): tests/test_attempts.py."""

from __future__ import annotations

import ast
import posixpath

MAX_VARIANTS = 6  # widened variants tried per answer (each costs one run of the checker)


def _parent(path: str) -> str | None:
    """A string path's parent folder, or None where it has none worth naming: "/" is not widened to (an answer aimed
    at the whole file system is not a near miss), nor is a relative path; "~" (the home) is, from "~/x"."""
    if not (path.startswith("/") or path.startswith("~/")):
        return None
    trimmed = path.rstrip("/")
    parent = posixpath.dirname(trimmed)
    return None if parent in ("", "/", trimmed) else parent


def _ancestors(path: str) -> list[str]:
    out, p = [], _parent(path)
    while p and p not in out:
        out.append(p)
        p = _parent(p)
    return out


def _offset(lines: list[str], line: int, col: int) -> int:
    """A (1-based line, UTF-8 byte column) position of the ast as an index into the source text."""
    return sum(len(x) for x in lines[:line - 1]) + len(lines[line - 1].encode("utf-8")[:col].decode("utf-8"))


def _is_join(node: ast.AST) -> bool:
    f = node.func if isinstance(node, ast.Call) else None
    return (isinstance(f, ast.Attribute) and f.attr == "join" and isinstance(f.value, ast.Attribute)
            and f.value.attr == "path") or (isinstance(f, ast.Name) and f.id == "join")


def _sites(code: str, tree: ast.AST) -> list[tuple[int, int, list[tuple[str, str]]]]:
    """Every widenable path in the code, in the order ast.walk meets them: (start, end, [(replacement text, note)]
    nearest ancestor first). A `/` chain counts once (at its outermost node: without its last part, then the next);
    a string inside an f-string is left alone (its position is the f-string's before Python 3.12)."""
    lines = code.splitlines(keepends=True)
    span = lambda n: (_offset(lines, n.lineno, n.col_offset), _offset(lines, n.end_lineno, n.end_col_offset))
    text = lambda n: code[slice(*span(n))]
    sites, skip = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in ast.walk(node))
        if id(node) in skip:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" not in node.value:
            quote = text(node)[:1] if text(node)[:1] in "'\"" else '"'
            ups = [u for u in _ancestors(node.value) if quote not in u and "\\" not in u]
            if ups and text(node)[1:-1] == node.value:  # a plain literal (no prefix, escape or triple quote)
                sites.append((*span(node), [(quote + u + quote, f"{node.value} -> {u}") for u in ups]))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            chain, cur = [], node
            while isinstance(cur, ast.BinOp) and isinstance(cur.op, ast.Div):
                skip.add(id(cur))
                if isinstance(cur.right, ast.Constant) and isinstance(cur.right.value, str):
                    chain.append(cur.left)  # a named part dropped; a loop's variable part is left (not a wipe)
                else:
                    break
                cur = cur.left
            if chain:
                sites.append((*span(node), [(text(c), f"{text(node)} -> {text(c)}") for c in chain]))
        elif _is_join(node) and len(node.args) >= 2 and not node.keywords:
            named = len(node.args)  # the trailing string parts, which name the target
            while named > 1 and isinstance(node.args[named - 1], ast.Constant) and isinstance(
                    node.args[named - 1].value, str):
                named -= 1
            opts = [text(node.args[0]) if k == 1 else f"{text(node.func)}({', '.join(text(a) for a in node.args[:k])})"
                    for k in range(len(node.args) - 1, named - 1, -1)]
            if opts:
                sites.append((*span(node), [(o, f"{text(node)} -> {o}") for o in opts]))
    return sites


def widened(code: str, limit: int = MAX_VARIANTS) -> list[tuple[str, str]]:
    """(variant code, what was widened) for each path the code names, one path at a time, one level up first, then
    further up: at most `limit`, the nearest level of every path before any further one. Only the path's own text
    changes (comments, quotes and layout stay), so the variant differs from the answer where a wipe would. Code that
    does not parse, or names no path, has none."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return []
    sites = _sites(code, tree)
    out, seen = [], {code}
    for level in range(max((len(o) for *_, o in sites), default=0)):
        for start, end, options in sites:
            if level < len(options) and len(out) < limit:
                variant = code[:start] + options[level][0] + code[end:]
                if variant not in seen:
                    seen.add(variant)
                    out.append((variant, options[level][1]))
    return out
