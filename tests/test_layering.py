"""The package's layers, as docs/design.md's table draws them, hold: no module imports from a layer above its
own or beside it (function-level imports included), no import cycle, no module over 400 lines. The checks run
on the package as it is, and on small packages written to break each rule once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "design.md"
MAX_MODULE_LINES = 400

Layers = dict[str, tuple[list[str], set[str]]]  # layer -> (the modules and packages it holds, what it may import)


def read_layers(design: Path = DESIGN) -> Layers:
    """The table under docs/design.md's "| layer | modules | may import |" header."""
    text = design.read_text()
    table = text[text.index("| layer | modules | may import |") :].split("\n\n", 1)[0].splitlines()[2:]
    layers: Layers = {}
    for row in table:
        layer, modules, may_import = (cell.strip() for cell in row.strip("|").split("|"))
        layers[layer] = (re.findall(r"`([\w.]+)`", modules), {name.strip() for name in may_import.split(",") if name.strip()})
    return layers


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `path` (module `name`) imports anywhere in its code: `from a import b` names
    the module a.b where that is a module, else a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {imported for imported in found if imported in modules and imported != name}


def layer_of(name: str, layers: Layers) -> str:
    """The layer whose longest entry names the module or a package holding it; `base` for none."""
    best, layer = "", "base"
    for candidate, (entries, _) in layers.items():
        for entry in entries:
            if (name == entry or name.startswith(entry + ".")) and len(entry) > len(best):
                best, layer = entry, candidate
    return layer


def layering_violations(root: Path, layers: Layers) -> list[str]:
    modules = package_modules(root)
    problems = []
    for name, path in modules.items():
        layer = layer_of(name, layers)
        allowed = layers[layer][1] | {layer}
        for imported in sorted(imports_of(path, name, modules)):
            if layer_of(imported, layers) not in allowed:
                problems.append(f"{name} ({layer}) imports {imported} ({layer_of(imported, layers)})")
    return problems


def import_cycles(root: Path) -> list[list[str]]:
    """The package's import cycles: strongly connected groups of more than one module (Tarjan)."""
    modules = package_modules(root)
    graph = {name: imports_of(path, name, modules) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return cycles


def long_modules(root: Path) -> list[str]:
    return [f"{name}: {n} lines" for name, path in package_modules(root).items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]


def test_the_package_keeps_its_layers():
    layers = read_layers()
    assert {"base", "formats", "mappings", "mcore", "megatron_lm", "converters", "verify", "commands"} <= set(layers)
    assert layering_violations(REPO / "mconvert", layers) == []


def test_no_import_cycles_and_no_long_modules():
    assert import_cycles(REPO / "mconvert") == []
    assert long_modules(REPO / "mconvert") == []


def _write_package(root: Path, files: dict[str, str]) -> Path:
    package = root / "mconvert"
    for name, code in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
        for parent in path.relative_to(package).parents:
            (package / parent / "__init__.py").touch()
    return package


def test_an_injected_upward_import_a_cycle_and_a_long_module_are_caught(tmp_path):
    layers = read_layers()
    package = _write_package(tmp_path, {
        "errors.py": "",
        "mappings/spec.py": "from mconvert.errors import ConversionError\n",
        # A file format that knows of a model family, and a family that reaches into the conversion.
        "formats/safetensors.py": "def read():\n    from mconvert.mappings import spec\n",
        "mappings/llama.py": "from mconvert.converters import plan\n",
        "converters/plan.py": "from mconvert.mcore.layout import tensor_layout\n",
        "mcore/layout.py": "from mconvert.mcore import parallelism\n",
        "mcore/parallelism.py": "import mconvert.mcore.layout\n" + "x = 1\n" * (MAX_MODULE_LINES + 1),
        "newcomer.py": "from mconvert.formats import safetensors\n",
    })
    assert layering_violations(package, layers) == [
        "mconvert.formats.safetensors (formats) imports mconvert.mappings.spec (mappings)",
        "mconvert.mappings.llama (mappings) imports mconvert.converters.plan (converters)",
        "mconvert.newcomer (base) imports mconvert.formats.safetensors (formats)",
    ]
    assert import_cycles(package) == [["mconvert.mcore.layout", "mconvert.mcore.parallelism"]]
    assert long_modules(package) == [f"mconvert.mcore.parallelism: {MAX_MODULE_LINES + 2} lines"]
