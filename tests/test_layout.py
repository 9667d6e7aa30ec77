"""The product package holds the product: no import cycles inside router/, nothing in it but the CLI reaches
the benches, the demo or the simulator, and heavy optional dependencies are imported only where used."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def top_level_imports(path: Path) -> set[str]:
    """Modules imported when ``path`` is imported (module level, outside ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    pkg = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            elif isinstance(node, ast.If | ast.Try):
                visit(node.body)
                for h in getattr(node, "handlers", []):
                    visit(h.body)
                visit(node.orelse)

    visit(tree.body)
    return out


def router_graph() -> dict[str, set[str]]:
    files = [p for p in (ROOT / "router").rglob("*.py") if "gen" not in p.parts]
    names = {module_name(p): p for p in files}
    graph = {}
    for name, path in names.items():
        graph[name] = {m for m in top_level_imports(path) if m in names and m != name}
    return graph


def test_no_import_cycles_inside_router():
    graph = router_graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt):], nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                dfs(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            dfs(node)


def test_the_product_never_imports_the_benches_or_heavy_extras_at_module_level():
    for path in (ROOT / "router").rglob("*.py"):
        if "gen" in path.parts:
            continue
        imports = top_level_imports(path)
        bad = {m for m in imports if m.split(".")[0] in {"bench", "matplotlib", "kubernetes", "sim", "tests"}}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)} when imported"
    for path in (ROOT / "router" / "frontends").rglob("*.py"):
        text = path.read_text()
        assert "import bench" not in text and "from bench" not in text, path


def test_the_default_tokenizer_is_package_data():
    import tomllib

    from router.tokenizer import DEFAULT_TOKENIZER_DIR

    assert DEFAULT_TOKENIZER_DIR.is_relative_to(ROOT / "router")
    assert (DEFAULT_TOKENIZER_DIR / "tokenizer.json").is_file()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "data/*.json" in data["router"]
