"""The text of an inject report's module tables, fitted to the terminal.

A model repeats its blocks (layers.0 ... layers.31): rows whose module names differ only in their last index, with
the same type and text, are one row naming the indices (`layers.{0-31}.mlp`). A fused module is named relative to
the row's module where they share a parent (`conv1  Conv2d  conv2d+bn+relu  (also bn1, relu)`). Rows that do not fit
the width in three columns are written in two lines each: the name (broken after a dot where it is longer than the
width), then the type and the text, indented.
"""
import re
import shutil
import textwrap

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")  # a path component that is a number


def terminal_width() -> int:
    """The terminal's columns ($COLUMNS first), 100 where there is no terminal (a pipe, a log)."""
    return shutil.get_terminal_size((100, 24)).columns


def relative(name: str, fused: list) -> str:
    """The fused modules' names, each without the parent it shares with `name`."""
    parent = name.rpartition(".")[0]
    return ", ".join(f[len(parent) + 1:] if parent and f.startswith(parent + ".") else f for f in fused)


def _indices(values: list) -> str:
    """{0-3,5}: sorted indices, runs as ranges."""
    values, runs = sorted(set(values)), []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return "{" + ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) + "}"


def _collapse_at(rows: list, k: int) -> list:
    """Rows that differ only in the k-th index from the right of their name (the same index in their text too), with
    the same type and text otherwise, merged into one, in the order of their first row."""
    groups: dict = {}
    for name, kind, text in rows:
        found = list(_INDEX.finditer(name))
        if len(found) < k:
            groups.setdefault((name, kind, text), None)
            continue
        at = found[-k]
        head, index, tail = name[:at.start()], at.group(), name[at.end():]
        key = (head + "\0" + tail, kind, text.replace(head + index + ".", head + "\0."))
        groups.setdefault(key, []).append(int(index))
    merged = []
    for (name, kind, text), indices in groups.items():
        if indices is not None:
            mark = str(indices[0]) if len(indices) == 1 else _indices(indices)
            name, text = name.replace("\0", mark), text.replace("\0", mark)
        merged.append((name, kind, text))
    return merged


def collapse(rows: list) -> list:
    """(name, type, text) rows with a model's repeated blocks merged: rows that differ only in one index of their
    name, the last first (`stages.1.layers.{0-1}.attn`, `blocks.{0-5}.0` for the first child of each block)."""
    depth = max((len(_INDEX.findall(name)) for name, _, _ in rows), default=0)
    for k in range(1, depth + 1):
        rows = _collapse_at(rows, k)
    return rows


def _broken(name: str, width: int) -> list:
    """name on lines of at most `width` characters, broken after dots (a part longer than width stays whole)."""
    lines = [""]
    for part in re.findall(r"[^.]+\.?", name):
        if lines[-1] and len(lines[-1]) + len(part) > width:
            lines.append("")
        lines[-1] += part
    return lines


def render(tables: list, width: int) -> list:
    """Lines of the tables [(title, type title, text title, rows)], rows (name, type, text), the empty tables left out:
    three aligned columns where every row fits `width`, else two lines a row."""
    tables = [(*titles, collapse(rows)) for *titles, rows in tables if rows]
    names = [(title, kind) for title, kind, _, rows in tables] + [(n, k) for *_, rows in tables for n, k, _ in rows]
    w0, w1 = (max(len(row[i]) for row in names) for i in (0, 1))
    lines = []
    if all(4 + w0 + w1 + len(text) + 2 <= width for *_, rows in tables for *_, text in rows):
        for title, kind_title, text_title, rows in tables:
            lines.append(f"  {title:<{w0}}  {kind_title:<{w1}}  {text_title}")
            lines += [f"  {name:<{w0}}  {kind:<{w1}}  {text}" for name, kind, text in rows]
        return lines
    for title, kind_title, text_title, rows in tables:
        lines.append(f"  {title}: {kind_title}, {text_title}")
        for name, kind, text in rows:
            lines += [("  " if i == 0 else "    ") + part for i, part in enumerate(_broken(name, width - 4))]
            lines += textwrap.wrap(f"{kind}  {text}", width, initial_indent=" " * 6, subsequent_indent=" " * 8)
    return lines
