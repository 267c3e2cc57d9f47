"""The repository's git hooks: ``.githooks/commit-msg`` refuses a subject line over 72 characters (merges aside), and
``make hooks`` (run by ``make install``) installs them only where the folder is a git checkout's top."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / ".githooks" / "commit-msg"

pytestmark = pytest.mark.skipif(shutil.which("sh") is None or shutil.which("git") is None, reason="needs sh and git")


def run_hook(tmp_path: Path, message: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    msg = tmp_path / "COMMIT_EDITMSG"
    msg.write_text(message, encoding="utf-8")
    return subprocess.run(["sh", str(HOOK), str(msg)], cwd=cwd or tmp_path, capture_output=True, text=True)


@pytest.mark.parametrize(
    "message",
    [
        "x" * 72 + "\n",
        "docs/gpu.md: a user guide to the attn_impl kernels\n\nThe why, and the figures " + "y" * 200 + "\n",
        "# Please enter the commit message" + " z" * 60 + "\n\nshort subject after a comment\n",
        "\n\n  short subject after blank lines\n",
        "é" * 72 + "\n",  # characters, not bytes
        "Merge branch 'docs' into main: " + "m" * 80 + "\n",
        "fixup! " + "f" * 72 + "\n",
    ],
    ids=["72", "body", "comment", "blank", "utf8", "merge", "fixup"],
)
def test_commit_msg_accepts(tmp_path, message):
    r = run_hook(tmp_path, message)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    "message", ["x" * 73 + "\n", "é" * 73 + "\n\nbody\n", "squash! " + "s" * 73 + "\n"], ids=["73", "utf8", "squash"]
)
def test_commit_msg_refuses_a_long_subject(tmp_path, message):
    r = run_hook(tmp_path, message)
    assert r.returncode == 1
    assert "subject line is 73 characters; at most 72" in r.stderr
    assert str(tmp_path / "COMMIT_EDITMSG") in r.stderr  # where the message was kept


def test_commit_msg_lets_git_merge_through(tmp_path):
    """A merge's message (MERGE_HEAD present) passes whatever its subject, as git writes it."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    head = subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=tmp_path, input="x", text=True,
                          capture_output=True, check=True).stdout.strip()  # fmt: skip
    (tmp_path / ".git" / "MERGE_HEAD").write_text(head + "\n")
    assert run_hook(tmp_path, "m" * 100 + "\n").returncode == 0


def test_make_hooks_installs_only_at_a_checkouts_top(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("needs make")
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")

    def make_hooks(cwd: Path) -> None:
        subprocess.run(["make", "-s", "hooks"], cwd=cwd, check=True, capture_output=True)

    def hooks_path(cwd: Path) -> str:
        return subprocess.run(["git", "config", "core.hooksPath"], cwd=cwd, capture_output=True, text=True).stdout

    make_hooks(tmp_path)  # not a git checkout (an sdist): nothing, and no failure
    assert not (tmp_path / ".git").exists()
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    sub = tmp_path / "unpacked"
    sub.mkdir()
    shutil.copy(ROOT / "Makefile", sub / "Makefile")
    make_hooks(sub)  # inside another checkout, not its top: that checkout is left alone
    assert hooks_path(tmp_path) == ""
    make_hooks(tmp_path)
    assert hooks_path(tmp_path).strip() == ".githooks"
