"""The README's code runs as written, and its layout table names real paths.

Every ```python block of README.md runs on the CPU exactly as written, each in a fresh
namespace. A block whose imports are not installed here (torch in the Python 3.12 run,
a module not yet in the repository) is skipped, naming the module; any other error fails.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def _sections(text: str) -> dict[str, str]:
    """`## heading` -> the text up to the next such heading."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def python_blocks(text: str) -> list[tuple[str, str]]:
    """(the heading of the section holding it, the code) of every python block."""
    return [(heading, code) for heading, body in _sections(text).items()
            for code in PYTHON_BLOCK.findall(body)]


def imported_modules(code: str) -> list[str]:
    """The modules the code imports, in order (`import a.b` and `from a.b import c`)."""
    names = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module)
    return names


def missing_module(code: str) -> str | None:
    """The first module the code imports that is not installed, or None. A module of this
    repository that fails to import for a reason of its own is an error, not a skip."""
    for name in imported_modules(code):
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError as error:  # a parent package is missing
            if error.name.startswith("xattn") and not name.startswith(error.name):
                raise
            return error.name
        if not found:
            return name
    return None


BLOCKS = python_blocks(README.read_text())


def test_the_readme_has_its_code_blocks():
    headings = [heading for heading, _ in BLOCKS]
    assert headings == ["Use from JAX", "Use from PyTorch",
                        "Serving: a paged KV cache, page selection, attention on the "
                        "selected pages", "In a serving engine: one call per step",
                        "In a serving engine: one call per step",
                        "Use in a transformers model"]


@pytest.mark.parametrize("heading, code", BLOCKS, ids=[h for h, _ in BLOCKS])
def test_readme_block_runs_as_written(heading, code, tmp_path, monkeypatch):
    missing = missing_module(code)
    if missing is not None:
        pytest.skip(f"the block imports {missing}, which is not installed here")
    monkeypatch.chdir(tmp_path)  # anything a block writes stays out of the checkout
    exec(compile(code, f"README.md ({heading})", "exec"), {"__name__": "__readme__"})


def test_layout_paths_exist():
    layout = _sections(README.read_text())["Layout"]
    paths = [p for p in re.findall(r"`([^` ]+)`", layout) if "/" in p]
    assert len(paths) >= 9
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"README.md's layout section names paths that do not exist: {missing}"


def test_missing_module_finds_what_is_not_installed():
    assert missing_module("import json\nfrom os import path") is None
    assert missing_module("import json\nimport no_such_module_here.sub") == \
        "no_such_module_here"
    assert missing_module("from xattn_jax import no_such_name") is None  # a name, not a module
    assert missing_module("import xattn_jax.no_such_module") == "xattn_jax.no_such_module"
