"""Hypothesis strategies shared by the property tests: JSON values, valid records with one thing changed, and
the byte-level damage that real files carry (bad UTF-8, deep nesting, huge lines, byte-order marks)."""
import copy
import json

from hypothesis import strategies as st

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)

# Values that broke the kit before: unhashable roles, NaN, surrogates, empty containers.
NASTY = st.sampled_from([[], {}, ["user"], {"role": "user"}, float("nan"), float("inf"), "", " ", "\ud800", "\x00",
                         2 ** 64, -1, True, None, "user", "assistant", "system"])


def positions(value, path=()):
    """Every place inside a JSON value, as a path of keys and indexes (the value itself is ())."""
    yield path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield from positions(item, (*path, key))


@st.composite
def mutated(draw, value):
    """value (or one drawn from it, a strategy) with one change at a place chosen evenly among all of them:
    replaced (by a value that broke the kit before, half the time), dropped, or with an item added."""
    if isinstance(value, st.SearchStrategy):
        value = draw(value)
    value = copy.deepcopy(value)
    path = draw(st.sampled_from(list(positions(value))))
    if not path:
        return draw(NASTY | JSON)
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    action = draw(st.sampled_from(["replace", "replace", "drop", "add"]))
    if action == "replace":
        parent[path[-1]] = draw(NASTY | JSON)
    elif action == "drop":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[draw(st.text(max_size=10))] = draw(NASTY | JSON)
    else:
        parent.insert(draw(st.integers(0, len(parent))), draw(NASTY | JSON))
    return value


DEEP = b"[" * 5000 + b"]" * 5000
BAD_LINES = st.sampled_from([
    DEEP, b'{"a": ' * 3000 + b"1" + b"}" * 3000, b"\xff\xfe\xfd", b"caf\xe9", b"\xef\xbb\xbf{}", b"{", b"[]", b"null",
    b'"\\ud800"', b"NaN", b"1e999", b"{" + b'"k": 1, ' * 20000 + b'"z": 2}', b"\x00", b"\r",
])


@st.composite
def lines(draw, valid: list):
    """JSON Lines bytes: valid records, mutated ones, raw JSON values and damaged lines, in any order."""
    out = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["valid", "mutated", "json", "bad", "huge"]))
        if kind == "valid":
            out.append(json.dumps(draw(st.sampled_from(valid))).encode())
        elif kind == "mutated":
            out.append(json.dumps(draw(mutated(draw(st.sampled_from(valid))))).encode())
        elif kind == "json":
            out.append(json.dumps(draw(JSON)).encode())
        elif kind == "huge":  # a quarter-megabyte line: one long string inside a valid record
            record = copy.deepcopy(draw(st.sampled_from(valid)))
            record[sorted(record)[0]] = "x" * (1 << 18)
            out.append(json.dumps(record).encode())
        else:
            out.append(draw(BAD_LINES))
    text = b"\n".join(out)
    if draw(st.booleans()):
        text = b"\xef\xbb\xbf" + text  # a byte-order mark
    return text + (b"\n" if draw(st.booleans()) else b"")
