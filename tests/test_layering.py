"""The packages' layering, read from the source files (every import, also those inside
functions): the Mosaic and Triton backends import nothing of each other, `impls` reaches
the backends only through their `backend.py`, no module imports another package's private
names, and only the resolver (`impls`) compares implementation names."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = sorted(p for package in ("xattn_jax", "xattn_torch_bridge")
                 for p in (ROOT / package).rglob("*.py"))
BACKEND_NAMES = ("reference", "triton", "mosaic", "auto")


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p) for p in SOURCES}


def _imports(path: pathlib.Path) -> list[tuple[str, tuple[str, ...]]]:
    """(module, names imported from it) for every import statement of `path`; a plain
    `import a.b` names nothing."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, tuple(alias.name for alias in node.names)))
    return found


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Every module `path` imports: `from m import n` counts as m.n where that is one of
    the packages' modules, else as m."""
    modules = set()
    for module, names in _imports(path):
        submodules = {f"{module}.{name}" for name in names} & MODULES
        modules.update(submodules or {module})
        if len(submodules) < len(names):
            modules.add(module)
    return modules


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_sources_are_found():
    assert {"xattn_jax.impls", "xattn_jax.mosaic.backend", "xattn_jax.triton.backend",
            "xattn_jax.reference.backend", "xattn_torch_bridge.hf"} <= MODULES


@pytest.mark.parametrize("package, other", [("xattn_jax.mosaic", "xattn_jax.triton"),
                                            ("xattn_jax.triton", "xattn_jax.mosaic")])
def test_the_kernel_backends_import_nothing_of_each_other(package, other):
    for path in SOURCES:
        if _within(_module(path), package):
            wrong = sorted(m for m in _imported_modules(path) if _within(m, other))
            assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}"


def test_impls_reaches_the_backends_through_their_backend_modules():
    allowed = {"xattn_jax", "xattn_jax.backend", "xattn_jax.reference",
               *(f"xattn_jax.{b}.backend" for b in ("reference", "triton", "mosaic"))}
    imported = {m for m in _imported_modules(ROOT / "xattn_jax" / "impls.py")
                if _within(m, "xattn_jax")}
    assert imported <= allowed, sorted(imported - allowed)
    assert {f"xattn_jax.{b}.backend" for b in ("reference", "triton", "mosaic")} <= imported


def test_no_private_name_crosses_a_package():
    """`from a.b import _c` only within package `a.b`'s own package."""
    for path in SOURCES:
        importer = _module(path).rsplit(".", 1)[0] if path.name != "__init__.py" \
            else _module(path)
        for module, names in _imports(path):
            if not module.startswith(("xattn_jax", "xattn_torch_bridge")):
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            owner = module.rsplit(".", 1)[0]
            assert not private or importer == owner, \
                f"{path.relative_to(ROOT)} imports {private} from {module}"


def test_only_the_resolver_compares_implementation_names():
    for path in SOURCES:
        if path == ROOT / "xattn_jax" / "impls.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                strings = [c.value for c in (node.left, *node.comparators)
                           if isinstance(c, ast.Constant) and isinstance(c.value, str)]
                assert not set(strings) & set(BACKEND_NAMES), \
                    f"{path.relative_to(ROOT)}:{node.lineno} compares {strings}"
