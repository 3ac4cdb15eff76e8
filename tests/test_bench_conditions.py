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
    """A `git archive` of the tree (no .git, as `--against` copies often are) is named by the commit it
    was made from; a copy of the files made otherwise is "unknown", never the commit around it."""
    head = _head()
    assert checkout_commit().startswith(head)
    archive = tmp_path / "tree.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), "HEAD"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "archived", filter="data")
    assert checkout_commit(tmp_path / "archived") == f"{head} (from git archive)"
    copied = tmp_path / "archived" / "copied"  # inside the archive's tree, which is no checkout either
    (copied / ARCHIVED_COMMIT).parent.mkdir(parents=True)
    shutil.copy(ROOT / ARCHIVED_COMMIT, copied / ARCHIVED_COMMIT)
    assert checkout_commit(copied) == "unknown"
