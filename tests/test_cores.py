"""How many workers serve starts without `workers`: one per CPU the process may use, from its cores and
its cgroup's CPU quota."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway import cores

V2 = "/sys/fs/cgroup/cpu.max"
PARENT_V2 = "/sys/fs/cgroup/system.slice/cpu.max"
V1_QUOTA = "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us"
V1_PERIOD = "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us"


@pytest.mark.parametrize(
    ("usable", "files", "count", "source"),
    [
        (16, {}, 16, "the cores this process may run on: 16; no CPU quota"),
        (16, {V2: "max 100000\n"}, 16, "the cores this process may run on: 16; no CPU quota"),
        (16, {V2: "150000 100000\n"}, 2, f"a CPU quota of 1.5 ({V2}: 150000 100000)"),
        (16, {V2: "50000 100000\n"}, 1, f"a CPU quota of 0.5 ({V2}: 50000 100000)"),
        (16, {V2: "1000 100000\n"}, 1, f"a CPU quota of 0.01 ({V2}: 1000 100000)"),
        (16, {V2: "300000 100000\n"}, 3, f"a CPU quota of 3 ({V2}: 300000 100000)"),
        (
            4,
            {V2: "800000 100000\n"},
            4,
            f"the cores this process may run on: 4; a CPU quota of 8 ({V2}: 800000 100000) allows them all",
        ),
        (
            16,
            {V2: "max 100000\n", PARENT_V2: "100000 100000\n"},
            1,
            f"a CPU quota of 1 ({PARENT_V2}: 100000 100000)",
        ),
        (
            16,
            {V2: "400000 100000\n", PARENT_V2: "250000 100000\n"},
            3,
            f"a CPU quota of 2.5 ({PARENT_V2}: 250000 100000)",
        ),
        (
            16,
            {V1_QUOTA: "-1\n", V1_PERIOD: "100000\n"},
            16,
            "the cores this process may run on: 16; no CPU quota",
        ),
        (
            16,
            {V1_QUOTA: "250000\n", V1_PERIOD: "100000\n"},
            3,
            f"a CPU quota of 2.5 ({V1_QUOTA}: 250000, cpu.cfs_period_us: 100000)",
        ),
        (16, {V1_QUOTA: "250000\n"}, 16, "the cores this process may run on: 16; no CPU quota"),
        (16, {V2: "a lot\n", V1_QUOTA: "x\n", V1_PERIOD: "0\n"}, 16, "the cores this process may run on: 16"),
        (0, {}, 1, "the cores this process may run on: 1; no CPU quota"),
    ],
    ids=[
        "no-cgroup",
        "v2-no-quota",
        "v2-one-and-a-half",
        "v2-half",
        "v2-a-hundredth",
        "v2-three-exactly",
        "v2-more-than-the-cores",
        "v2-a-parents-quota",
        "v2-the-tighter-of-two",
        "v1-no-quota",
        "v1-two-and-a-half",
        "v1-without-its-period",
        "unreadable",
        "no-cores-reported",
    ],
)
def test_workers_follow_the_cpus_the_process_may_use(
    usable: int, files: dict[str, str], count: int, source: str
) -> None:
    """One worker per usable core, or per CPU of the tightest quota rounded up when fewer; at least one."""
    workers = cores.workers(usable, files)
    assert workers.count == count
    assert workers.source.startswith(source)


# /proc/self/mountinfo's lines for each hierarchy, as the kernel writes them.
CONTAINER_V2 = "30 25 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate\n"
HOST_V2 = "35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw\n"
DOCKER_V1 = (
    "1210 1200 0:31 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
    "1211 1200 0:32 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n"
)
HYBRID = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)


@pytest.mark.parametrize(
    ("mountinfo", "cgroups", "dirs"),
    [
        (CONTAINER_V2, "0::/\n", ["/sys/fs/cgroup"]),
        (
            HOST_V2,
            "0::/system.slice/effect-gateway.service\n",
            [
                "/sys/fs/cgroup/system.slice/effect-gateway.service",
                "/sys/fs/cgroup/system.slice",
                "/sys/fs/cgroup",
            ],
        ),
        (DOCKER_V1, "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n", ["/sys/fs/cgroup/cpu,cpuacct"]),
        (
            HYBRID,
            "1:cpu:/agents\n0::/\n",
            ["/sys/fs/cgroup/cpu/agents", "/sys/fs/cgroup/cpu", "/sys/fs/cgroup/unified"],
        ),
        (CONTAINER_V2.replace("/sys/fs/cgroup", "/mnt/my\\040cgroups"), "0::/\n", ["/mnt/my cgroups"]),
        (CONTAINER_V2, "", []),
        ("", "0::/\n", []),
    ],
    ids=[
        "container-v2",
        "systemd-service-v2",
        "docker-v1",
        "hybrid",
        "space-in-mount",
        "no-cgroup",
        "no-mount",
    ],
)
def test_the_quota_is_looked_for_from_the_cgroup_of_the_process_up(
    mountinfo: str, cgroups: str, dirs: list[str]
) -> None:
    """The process's own cgroup directory and each above it to the mount, in v2 and in v1's cpu hierarchy."""
    assert cores.cgroup_dirs(mountinfo, cgroups) == dirs


def test_the_files_are_read_where_proc_says(tmp_path: Path) -> None:
    """The reader finds a service's cgroup through /proc's files and reads the quota of it and its parents."""
    mount = tmp_path / "cgroup"
    service = mount / "gateway.slice" / "gateway.service"
    service.mkdir(parents=True)
    (service / "cpu.max").write_text("max 100000\n")
    (mount / "gateway.slice" / "cpu.max").write_text("150000 100000\n")
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "mountinfo").write_text(f"35 24 0:30 / {mount} rw,relatime - cgroup2 cgroup2 rw\n")
    (proc / "cgroup").write_text("0::/gateway.slice/gateway.service\n")
    usable, files = cores.read(proc)
    assert usable == len(os.sched_getaffinity(0))
    assert files == {
        f"{service}/cpu.max": "max 100000\n",
        f"{mount}/gateway.slice/cpu.max": "150000 100000\n",
    }
    assert cores.workers(16, files).count == 2


def test_a_configured_count_is_used_as_it_is() -> None:
    """`workers` set in the configuration is what serve starts, whatever the CPUs."""
    assert cores.to_start(7) == cores.Workers(7, "the workers setting")
