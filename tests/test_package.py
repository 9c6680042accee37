"""The packages as installed: `xattn_jax.__version__` is pyproject's version, both packages
ship a PEP 561 `py.typed` marker, and importing the bridge without torch names the extra
to install. Torch-free (the bridge is imported in a subprocess with torch hidden)."""

from __future__ import annotations

import importlib.metadata
import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

import xattn_jax

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("xattn_jax", "xattn_torch_bridge")


def _pyproject() -> dict:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def test_version_is_pyprojects():
    assert xattn_jax.__version__ == _pyproject()["project"]["version"]


def test_version_of_a_source_checkout_that_is_not_installed(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert xattn_jax._version() == _pyproject()["project"]["version"]


def test_both_packages_have_a_py_typed_marker():
    package_data = _pyproject()["tool"]["setuptools"]["package-data"]
    for package in PACKAGES:
        assert (ROOT / package / "py.typed").is_file(), package
        assert "py.typed" in package_data[package], package


def _setuptools_builds_this_pyproject() -> bool:
    """Whether this environment's setuptools meets pyproject's build requirement (a 3.11
    venv's bundled setuptools does not; the 3.12 venv has none)."""
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return False
    return major >= 77


@pytest.mark.skipif(not _setuptools_builds_this_pyproject(),
                    reason="needs setuptools >= 77 (pyproject's build requirement)")
def test_wheel_ships_py_typed(tmp_path):
    """A wheel built from a copy of the sources holds both markers (under a second)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    build = ("import sys, setuptools.build_meta as b; "
             "print(b.build_wheel(sys.argv[1]))")
    done = subprocess.run([sys.executable, "-c", build, str(tmp_path / "dist")], cwd=source,
                          capture_output=True, text=True, check=True)
    wheel = tmp_path / "dist" / done.stdout.strip().splitlines()[-1]
    names = zipfile.ZipFile(wheel).namelist()
    for package in PACKAGES:
        assert f"{package}/py.typed" in names, names


HIDE_TORCH = """
import importlib.abc, sys

class HideTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.modules.pop("torch", None)
sys.meta_path.insert(0, HideTorch())
import xattn_torch_bridge
"""


def test_bridge_without_torch_names_the_extra():
    done = subprocess.run([sys.executable, "-c", HIDE_TORCH], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: xattn_torch_bridge needs torch"), done.stderr
    assert "pip install 'xattn-jax[torch]'" in last, done.stderr
