"""The package's floors: the algorithm imports no engine, the engines no integration, and the library (algorithm,
engines, integrations) neither the pretraining script's folder ``lm`` nor the tools; imports inside functions
count too."""

from __future__ import annotations

import ast
from pathlib import Path

import hdet_scale

PACKAGE = Path(hdet_scale.__file__).parent
FRONT_DOORS = {"__init__", "schedule"}  # the public API and the drop-in scheduler, which attaches through DDP
FLOORS = ("core", "front", "engines", "integrations", "lm", "tools")
ALLOWED = {
    "core": {"core"},
    "front": {"core", "front", "engines"},
    "engines": {"core", "engines"},
    "integrations": {"core", "front", "engines", "integrations"},
    "lm": {"core", "front", "engines", "lm"},
    "tools": {"core", "tools"},
}


def floor_of(module: str) -> str:
    """The floor of a dotted module name inside the package (``hdet_scale.engines.ddp`` -> ``engines``)."""
    parts = module.split(".")[1:]
    if not parts:
        return "front"
    if parts[0] in ("engines", "integrations", "lm", "tools"):
        return parts[0]
    return "front" if parts[0] in FRONT_DOORS else "core"


def is_module(name: str) -> bool:
    relative = PACKAGE.parent.joinpath(*name.split("."))
    return relative.with_suffix(".py").is_file() or (relative / "__init__.py").is_file()


def package_imports(path: Path) -> set[str]:
    """Every ``hdet_scale`` module a file imports, at any depth of the file (``from hdet_scale import config_rules``
    imports the module ``hdet_scale.config_rules``; ``from hdet_scale import HDETConfig`` the package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hdet_scale"):
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if is_module(submodule) else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("hdet_scale"))
    return found


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" and len(relative.parts) > 2 else relative.parts
    return ".".join(parts)


def test_floor_of_reads_the_folder_and_the_front_doors():
    assert floor_of("hdet_scale.controller") == "core"
    assert floor_of("hdet_scale.schedule") == "front"
    assert floor_of("hdet_scale") == "front"
    assert floor_of("hdet_scale.engines.fsdp") == "engines"
    assert floor_of("hdet_scale.lm.train") == "lm"
    assert floor_of("hdet_scale.tools.report") == "tools"


def test_package_imports_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import os\nfrom hdet_scale.config import HDETConfig\n"
                      "from hdet_scale import config_rules, HDETEnsemble\n"
                      "def f():\n    import hdet_scale.engines.ddp\n    from hdet_scale.lm import train\n")
    assert package_imports(source) == {"hdet_scale.config", "hdet_scale.config_rules", "hdet_scale",
                                       "hdet_scale.engines.ddp", "hdet_scale.lm.train"}


def test_no_module_imports_a_floor_below_its_own():
    offences = []
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 40  # the whole package was read
    for path in files:
        own = floor_of(module_name(path))
        for imported in package_imports(path):
            if floor_of(imported) not in ALLOWED[own]:
                offences.append(f"{path.relative_to(PACKAGE.parent)} ({own}) imports {imported}")
    assert offences == []


def test_the_zero_internals_are_read_by_the_deepspeed_engine_alone():
    """``engines/zero.py`` holds the DeepSpeed internals HDET relies on; the front doors and integrations go through
    ``engines/deepspeed.py`` and ``deepspeed_settings.py``."""
    readers = sorted(str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*.py")
                     if "hdet_scale.engines.zero" in package_imports(path))
    assert readers == ["hdet_scale/engines/deepspeed.py"]
