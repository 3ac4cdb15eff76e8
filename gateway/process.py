"""This process's pid, asked of the kernel once and again after each fork, not on every use.

``os.getpid`` is a system call (glibc stopped caching it), and the request path wanted it twice or more
per request: for the pid on each JSON log line, and in prometheus-client, which checks it before every
metric update to notice a fork. Python runs the ``register_at_fork`` hooks in every child that
``os.fork`` makes (``serve``'s workers; multiprocessing's fork and forkserver too), so the value here is
the child's own from its first line; a child made by ``subprocess`` runs no Python before it execs.
"""

from __future__ import annotations

import os


class _Process:
    __slots__ = ("pid",)

    def __init__(self) -> None:
        self.pid = os.getpid()
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self.pid = os.getpid()


_THIS = _Process()


def pid() -> int:
    """This process's pid (the log's lines and prometheus-client's multiprocess values ask it)."""
    return _THIS.pid
