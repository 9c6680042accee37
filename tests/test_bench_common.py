"""bench.common's records name the commit they ran on (CPU only: no kernel runs)."""

import re
import shutil
import subprocess

import pytest

from bench import common


def test_commit_is_the_checkouts_head():
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=common.__file__
                          .rsplit("/", 1)[0], capture_output=True, text=True)
    if head.returncode:
        assert common.commit() is None  # not a git checkout
        return
    got = common.commit()
    assert re.fullmatch(r"[0-9a-f]{7,}(-dirty)?", got), got
    assert got.split("-")[0] == head.stdout.strip()


def test_commit_outside_a_checkout_is_none(monkeypatch):
    def no_git(*args, **kwargs):
        return subprocess.CompletedProcess(args, 128, "", "fatal: not a git repository")

    monkeypatch.setattr(common.subprocess, "run", no_git)
    assert common.commit() is None
