"""The project's imports point one way and never form a circle.

Every import in the shipped packages' source (module level, inside functions, under
TYPE_CHECKING: all of them) becomes an edge of a graph, read with `ast`, plus any
`importlib.import_module("...")` / `__import__("...")` with a literal name. The rules:

    jax_attn        the functional core: never torch, interop, torch_backends, benchmarks
    torch_backends  vLLM's backends: never jax, jax_attn, interop, benchmarks
    interop         may import both halves; never benchmarks (`jax-attn bench` reaches
                    them through the `jax_attn.commands` entry point)
    benchmarks      may import every package; nothing else imports it

and no string imports of the project's own modules anywhere (a plugin registers through an
entry point instead), and no circle between modules.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jax_attn", "torch_backends", "interop", "benchmarks")
FORBIDDEN = {
    "jax_attn": {"torch", "xformers", "intel_extension_for_pytorch", "interop",
                 "torch_backends", "benchmarks"},
    "torch_backends": {"jax", "jaxlib", "jax_attn", "interop", "benchmarks"},
    "interop": {"benchmarks"},
    "benchmarks": set(),
}  # fmt: skip
DYNAMIC = "<computed name>"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of `from <level dots><name> import ...` inside `module`."""
    if level == 0:
        return name or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _string_import(node: ast.Call) -> str | None:
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if called not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return DYNAMIC  # a name computed at run time: it may be anything, the project included


def imports_of(source: str, module: str, is_package: bool, known: set[str]):
    """(imported module names, string-imported names) of one module's source. `from p import
    x` counts as importing `p.x` when that is one of the `known` modules, else `p`."""
    edges, strings = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                edges.add(sub if sub in known else base)
        elif isinstance(node, ast.Call) and (name := _string_import(node)):
            strings.add(name)
            if name != DYNAMIC:
                edges.add(name)
    return edges, strings


def build_graph(root: Path, packages=PACKAGES):
    """{module: imported names}, {module: string-imported names} over the packages' sources."""
    files = {
        module_name(path, root): path
        for package in packages
        for path in sorted((root / package).rglob("*.py"))
    }
    known = set(files)
    graph, strings = {}, {}
    for module, path in files.items():
        edges, found = imports_of(path.read_text(), module, path.name == "__init__.py", known)
        graph[module] = edges
        strings[module] = found
    return graph, strings


def _top(name: str) -> str:
    return name.split(".")[0]


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, edges in sorted(graph.items()):
        forbidden = FORBIDDEN.get(_top(module), set())
        for target in sorted(edges):
            if _top(target) not in forbidden:
                continue
            bad.append(f"{module} imports {target}")
    return bad


def string_import_violations(strings: dict[str, set[str]]) -> list[str]:
    return [
        f"{module} imports {name!r} by string"
        for module, names in sorted(strings.items())
        for name in sorted(names)
        if _top(name) in PACKAGES or name == DYNAMIC
    ]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles among the graph's own modules (strongly connected components with
    more than one module, or a module importing itself), each sorted."""
    nodes = sorted(graph)
    edges = {n: sorted(t for t in graph[n] if t in graph) for n in nodes}
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges[node]:
                found.append(sorted(component))

    for node in nodes:
        if node not in index:
            visit(node)
    return found


# ---------------------------------------------------------------------------------------------
# The project


@pytest.fixture(scope="module")
def project():
    return build_graph(ROOT)


def test_the_walk_sees_the_project(project):
    graph, _ = project
    assert {"jax_attn.paged", "torch_backends.registry", "interop.cli", "benchmarks.run"} <= set(
        graph
    )
    assert "jax" in graph["jax_attn.paged"]  # the walk does read imports
    assert "interop.crosscheck" in graph["interop.cli"]


def test_no_back_edges(project):
    graph, _ = project
    assert layering_violations(graph) == []


def test_no_string_imports_of_the_project(project):
    _, strings = project
    assert string_import_violations(strings) == []


def test_no_import_circles(project):
    graph, _ = project
    assert cycles(graph) == []


# ---------------------------------------------------------------------------------------------
# The checks can fail


def test_a_circle_is_found():
    graph = {"a.x": {"a.y", "numpy"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}
    assert cycles(graph) == [["a.x", "a.y", "a.z"]]
    assert cycles({"a.x": {"a.x"}}) == [["a.x"]]
    assert cycles({"a.x": {"a.y"}, "a.y": set()}) == []


def test_back_edges_are_found():
    graph = {
        "jax_attn.paged": {"jax", "torch"},
        "torch_backends.abstract": {"torch", "jax_attn.cache"},
        "interop.crosscheck": {"benchmarks.run", "jax_attn", "torch_backends"},
        "interop.cli": {"benchmarks.command"},
        "benchmarks.run": {"interop.crosscheck", "jax_attn", "torch_backends"},
    }
    assert layering_violations(graph) == [
        "interop.cli imports benchmarks.command",
        "interop.crosscheck imports benchmarks.run",
        "jax_attn.paged imports torch",
        "torch_backends.abstract imports jax_attn.cache",
    ]


def test_walk_reads_every_kind_of_import(tmp_path):
    """A fake tree: relative, lazy, TYPE_CHECKING and string imports all become edges."""
    pkg = tmp_path / "jax_attn"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text(
        "import importlib\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from interop import layouts\n"
        "def f():\n    from .sub import b\n    return importlib.import_module('torch_backends.x')\n"
        "def g(name):\n    return __import__(name)\n"
    )
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from .. import a\nimport torch.nn\n")
    graph, strings = build_graph(tmp_path, packages=("jax_attn",))
    assert graph["jax_attn"] == {"jax_attn.a"}
    assert graph["jax_attn.a"] == {
        "importlib", "typing", "interop", "jax_attn.sub.b", "torch_backends.x",
    }  # fmt: skip
    assert graph["jax_attn.sub.b"] == {"jax_attn.a", "torch.nn"}
    assert string_import_violations(strings) == [
        "jax_attn.a imports '<computed name>' by string",
        "jax_attn.a imports 'torch_backends.x' by string",
    ]
    assert layering_violations(graph) == [
        "jax_attn.a imports interop",
        "jax_attn.a imports torch_backends.x",
        "jax_attn.sub.b imports torch.nn",
    ]
    assert cycles(graph) == [["jax_attn.a", "jax_attn.sub.b"]]


def test_bench_reaches_the_cli_through_its_entry_point():
    """`jax-attn bench` without `interop` importing `benchmarks`: the installed distribution
    registers it in the `jax_attn.commands` group, and the CLI lists it."""
    from interop import cli

    plugins = cli.plugin_commands()
    assert plugins["bench"].__name__ == "benchmarks.command"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
