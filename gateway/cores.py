"""How many worker processes ``serve`` starts when ``workers`` is not set: as many as the CPUs it may use.

``os.cpu_count()`` counts the host's cores: a sidecar on a 16-core node, limited to half a core, started
16 workers there, each with its own connection pool and replay cache, in a 256 MiB container. What a
process may use is the fewer of

- the cores the scheduler lets it run on (``os.sched_getaffinity``: a cpuset, ``taskset``, systemd's
  ``AllowedCPUs=``), and
- its CPU quota, as Docker's ``--cpus``, Kubernetes' ``limits.cpu`` and systemd's ``CPUQuota=`` set it:
  cgroup v2's ``cpu.max`` (``150000 100000`` is 1.5 CPUs, ``max 100000`` no quota), or cgroup v1's
  ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` (a quota of -1: none), in the process's own cgroup
  or any above it (a parent's quota holds for everything under it);

the quota rounded up (1.5 CPUs get 2 workers, half a CPU 1), and never fewer than one worker.

:func:`workers` decides from the files' contents, :func:`cgroup_dirs` says where they are, and
:func:`read` reads them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

V2_QUOTA = "cpu.max"
V1_QUOTA = "cpu.cfs_quota_us"
V1_PERIOD = "cpu.cfs_period_us"
# mountinfo writes a space, a tab, a newline and a backslash in a path as octal escapes (\040).
_OCTAL = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True, slots=True)
class Workers:
    """How many worker processes to start, and where that number came from (for the start-up log)."""

    count: int
    source: str


@dataclass(frozen=True, slots=True)
class _Quota:
    quota: int  # microseconds of CPU time the group may use in each period
    period: int
    where: str  # the file(s) it was read from, with their contents

    @property
    def cpus(self) -> float:
        return self.quota / self.period

    @property
    def workers(self) -> int:
        # Rounded up in integers: the ceiling of a division in floats could make 4 of a quota of exactly 3.
        return -(-self.quota // self.period)


def to_start(configured: int | None) -> Workers:
    """Return the workers to start: ``workers`` when it is set, else one per CPU this process may use."""
    if configured is not None:
        return Workers(configured, "the workers setting")
    return workers(*read())


def workers(usable: int, files: Mapping[str, str]) -> Workers:
    """Return one worker per core in ``usable``, or per CPU of the tightest quota in ``files`` rounded up
    when that is fewer; at least one.

    ``files`` holds the contents of each quota file found, by its path: ``cpu.max`` (cgroup v2),
    ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` (v1). One that cannot be read as a quota is left out.
    """
    cores = max(1, usable)
    tightest = min(_quotas(files), key=lambda q: q.cpus, default=None)
    if tightest is None:
        return Workers(cores, f"the cores this process may run on: {cores}; no CPU quota")
    if tightest.workers >= cores:
        quota = f"a CPU quota of {tightest.cpus:g} ({tightest.where}) allows them all"
        return Workers(cores, f"the cores this process may run on: {cores}; {quota}")
    return Workers(max(1, tightest.workers), f"a CPU quota of {tightest.cpus:g} ({tightest.where})")


def _quotas(files: Mapping[str, str]) -> Iterator[_Quota]:
    for path, text in files.items():
        directory, _, name = path.rpartition("/")
        if name == V2_QUOTA:
            fields = text.split()
            if len(fields) == 2 and fields[0] != "max":  # "max": no quota
                quota = _positive(fields[0], fields[1], f"{path}: {text.strip()}")
                if quota is not None:
                    yield quota
        elif name == V1_QUOTA and f"{directory}/{V1_PERIOD}" in files:
            period = files[f"{directory}/{V1_PERIOD}"]
            where = f"{path}: {text.strip()}, {V1_PERIOD}: {period.strip()}"
            quota = _positive(text.strip(), period.strip(), where)  # -1: no quota
            if quota is not None:
                yield quota


def _positive(quota: str, period: str, where: str) -> _Quota | None:
    try:
        parsed = _Quota(int(quota), int(period), where)
    except ValueError:
        return None
    return parsed if parsed.quota > 0 and parsed.period > 0 else None


def cgroup_dirs(mountinfo: str, cgroups: str) -> list[str]:
    """Return the directories that may hold this process's CPU quota: its own cgroup's, and each above it
    up to where the hierarchy is mounted, in cgroup v2 and in v1's cpu hierarchy.

    ``mountinfo`` and ``cgroups`` are the contents of /proc/self/mountinfo and /proc/self/cgroup. A
    container usually sees its own cgroup as the root of the mount (mountinfo's root field): its
    directory is then the mount point itself.
    """
    v2: str | None = None
    v1: str | None = None
    for line in cgroups.splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and not controllers:
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    found: list[str] = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        after = fields.index("-")
        if len(fields) < after + 4 or after < 5:
            continue
        root, mount, kind, options = fields[3], fields[4], fields[after + 1], fields[after + 3]
        group = v2 if kind == "cgroup2" else v1 if kind == "cgroup" and "cpu" in options.split(",") else None
        if group is not None:
            found += _up_to_mount(_unescape(mount), _unescape(root), group)
    return found


def _up_to_mount(mount: str, root: str, path: str) -> list[str]:
    inside = PurePosixPath(path)
    relative = inside.relative_to(root) if inside.is_relative_to(root) else PurePosixPath(".")
    top = PurePosixPath(mount)
    here = top / relative
    dirs = [str(here)]
    while here != top:
        here = here.parent
        dirs.append(str(here))
    return dirs


def _unescape(path: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), path)


def read(proc: Path = Path("/proc/self")) -> tuple[int, dict[str, str]]:
    """Return the cores this process may run on, and the contents of the quota files of its cgroups
    (none where there are no cgroups: another system, a /proc that cannot be read)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity outside Linux
        usable = os.cpu_count() or 1
    try:
        dirs = cgroup_dirs((proc / "mountinfo").read_text(), (proc / "cgroup").read_text())
    except OSError:
        dirs = []
    files: dict[str, str] = {}
    for directory in dirs:
        for name in (V2_QUOTA, V1_QUOTA, V1_PERIOD):
            path = f"{directory}/{name}"
            try:
                files[path] = Path(path).read_text()
            except OSError:  # not in this hierarchy, or not this controller's
                continue
    return usable, files
