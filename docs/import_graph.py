"""The import graph of src/dropin, drawn from the code, as the Mermaid diagrams of docs/architecture.md.

Reads every module's imports with `ast` (function-level imports included, and strings that name a module or a
"module:function" for importlib, as cli.py's suites) and writes two diagrams between the markers in
docs/architecture.md: the layers (a subpackage is one node; an edge carries the number of module-to-module imports
it stands for) and the modules of ops/ (ops/conv2d/ is one node). An edge A --> B: A imports B.
    python docs/import_graph.py           # rewrites the diagrams in docs/architecture.md
    python docs/import_graph.py --check   # exits 1 where the committed diagrams differ from the code's
"""
import ast
import collections
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "dropin"
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- import graph: begin (python docs/import_graph.py) -->", "<!-- import graph: end -->"
LAYERS = ("ops", "nn", "inject", "bench")  # subpackages drawn as one node in the layer diagram


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path, modules: set) -> set:
    """The dropin modules that the module at path imports (a `from X import name` of a submodule counts as X.name)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value.split(":")[0])  # "dropin.x.y" or "dropin.x.y:function", for importlib
    return {m for m in found if m in modules and m != name}


def graph() -> dict:
    """module -> the dropin modules it imports."""
    paths = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports(p, modules) for p in paths}


def collapse(name: str, depth: int) -> str:
    """name cut to its first `depth` parts below dropin (dropin.ops.conv2d.tma -> dropin.ops at depth 1)."""
    return ".".join(name.split(".")[:depth + 1])


def node(name: str) -> str:
    return re.sub(r"\W", "_", name)


def mermaid(edges: collections.Counter, labels: bool) -> str:
    names = sorted({n for edge in edges for n in edge})
    lines = ["```mermaid", "graph TD"]
    lines += [f'  {node(n)}["{n.removeprefix("dropin.") or n}"]' for n in names]
    for (a, b), count in sorted(edges.items()):
        lines.append(f"  {node(a)} -->|{count}| {node(b)}" if labels else f"  {node(a)} --> {node(b)}")
    return "\n".join(lines + ["```"])


def diagrams() -> str:
    imported = graph()
    layers = collections.Counter()
    ops = collections.Counter()
    for a, targets in imported.items():
        for b in targets:
            la = collapse(a, 1) if collapse(a, 1) in {f"dropin.{p}" for p in LAYERS} else a
            lb = collapse(b, 1) if collapse(b, 1) in {f"dropin.{p}" for p in LAYERS} else b
            if la != lb and "dropin" not in (la, lb):
                layers[la, lb] += 1
            if a.startswith("dropin.ops.") and b.startswith("dropin.ops."):
                ca, cb = (n if not n.startswith("dropin.ops.conv2d.") else "dropin.ops.conv2d" for n in (a, b))
                if ca != cb:
                    ops[ca, cb] += 1
    return "\n\n".join([
        "Layers (an edge's number: the module-to-module imports it stands for):", mermaid(layers, True),
        "The modules of ops/ (ops/conv2d/ as one node):", mermaid(ops, False)])


def main(argv: list) -> int:
    text = DOC.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    new = text[:start] + "\n" + diagrams() + "\n" + text[end:]
    if "--check" in argv:
        if new != text:
            print(f"{DOC.relative_to(ROOT)}: the import graph is stale; run python docs/import_graph.py")
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
