"""What a benchmark says of the tree it measures."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

from bench.harness import ARCHIVED_COMMIT, ROOT, checkout_commit


def _head() -> str:
    done = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip()


def test_a_benchmark_names_the_commit_of_the_checkout_or_of_the_archive_it_runs_in(tmp_path: Path) -> None:
    """A `git archive` of the tree (no .git) is named by the commit it was made from; a copy of the
    files made otherwise is "unknown", never the commit of a checkout around it."""
    head = _head()
    assert checkout_commit().startswith(head)
    archive = tmp_path / "tree.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), "HEAD"], check=True)
    with tarfile.open(archive) as tar:
        # Our own archive; the safe filter where this Python has it (3.11.4 on).
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp_path / "archived", **safe)
    assert checkout_commit(tmp_path / "archived") == f"{head} (from git archive)"
    # A plain copy inside another checkout (git would find that one by searching upwards).
    outer = tmp_path / "outer"
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    subprocess.run(
        ["git", "-C", str(outer), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
         "--allow-empty", "-m", "outer"],
        check=True,
    )  # fmt: skip
    copied = outer / "copied"
    (copied / ARCHIVED_COMMIT).parent.mkdir(parents=True)
    shutil.copy(ROOT / ARCHIVED_COMMIT, copied / ARCHIVED_COMMIT)
    assert checkout_commit(copied) == "unknown"
