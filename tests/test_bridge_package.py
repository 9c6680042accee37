"""xattn_torch_bridge as a package: `dir()` lists exactly the public API."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("torch")

import xattn_torch_bridge  # noqa: E402

# Implementation details: importable (tests and callers that know them may use them), but
# not part of the listed API.
HIDDEN = ("PREALLOCATE", "preallocation_warning", "dlpack", "estimate", "kv_cache",
          "policy", "os", "warnings")


def test_dir_lists_exactly_the_public_names():
    assert set(dir(xattn_torch_bridge)) == set(xattn_torch_bridge.__all__)
    assert not set(HIDDEN) & set(dir(xattn_torch_bridge))


def test_every_public_name_resolves():
    for name in xattn_torch_bridge.__all__:
        assert getattr(xattn_torch_bridge, name) is not None, name


def test_hidden_names_stay_importable():
    for name in HIDDEN:
        assert hasattr(xattn_torch_bridge, name), name
    assert callable(xattn_torch_bridge.preallocation_warning)
    for sub in ("dlpack", "estimate", "kv_cache", "policy", "reference"):
        assert importlib.import_module(f"xattn_torch_bridge.{sub}") is getattr(
            xattn_torch_bridge, sub)


def test_star_import_gives_the_public_names():
    namespace: dict = {}
    exec("from xattn_torch_bridge import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(xattn_torch_bridge.__all__)
