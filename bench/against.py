"""Measure this tree's gateway beside another commit's, each with the libraries its own commit asks for.

Run: `make bench-against REF=13e385c` (or `python -m bench.against 13e385c [cpu_per_request's options]`).
The commit is unpacked (git archive) into .bench/trees/<commit>, and its gateway installed into a venv
of its own there, once; then bench.cpu_per_request runs both gateways in turns, at 16 and 64 concurrent
unless told otherwise, and prints per new effect and per replay each one's CPU, its Postgres's CPU and
WAL, their ratios, the p50 a new effect adds one at a time and the WAL flushes per new effect.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

from bench.harness import ARCHIVED_COMMIT, ROOT

TREES = ROOT / ".bench" / "trees"
# What the other gateway needs to run as users run it: its embedded Postgres and uvloop.
EXTRAS = "[embedded,fast]"
DEFAULTS = ["--concurrency", "16,64", "--repeat", "5"]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def checkout(ref: str) -> tuple[Path, Path]:
    """The commit's tree and its venv's interpreter, made if they are not there yet."""
    try:
        commit = _git("rev-parse", "--verify", f"{ref}^{{commit}}")
    except subprocess.CalledProcessError:
        sys.exit(f"bench-against: {ref!r} is no commit of this repository")
    tree = TREES / commit[:12]
    python = tree / ".venv" / "bin" / "python"
    if not (tree / ".venv" / ".installed").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        # Commits from before the archive named its own commit: the tables say which one it was.
        (tree / ARCHIVED_COMMIT).parent.mkdir(parents=True, exist_ok=True)
        (tree / ARCHIVED_COMMIT).write_text(commit + "\n")
        print(f"bench-against: installing {ref} ({commit[:12]}) into {tree / '.venv'}", flush=True)
        venv.create(tree / ".venv", with_pip=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", f"{tree}{EXTRAS}"], check=True)
        (tree / ".venv" / ".installed").touch()
    return tree, python


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python -m bench.against REF [bench.cpu_per_request options]")
    tree, python = checkout(sys.argv[1])
    options = sys.argv[2:] or DEFAULTS
    argv = [sys.executable, "-m", "bench.cpu_per_request", "--against", str(tree), "--python", str(python)]
    sys.exit(subprocess.run([*argv, *options], cwd=ROOT).returncode)


if __name__ == "__main__":
    main()
