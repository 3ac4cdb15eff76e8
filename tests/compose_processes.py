"""Run compose's services as plain processes, inside a network namespace of their own (no container engine).

Started by tests/test_deploy.py as ``unshare [--user --map-root-user] --net --mount python THIS PLAN.json``.
The namespace gives what compose's network gives: a loopback where the services' fixed ports are free,
and their service names as host names (an /etc/hosts bind-mounted in this mount namespace only). Each
service starts once the ones it depends on pass their own healthcheck command; then the plan's requests
are sent, and everything is printed as JSON on stdout. Standard library only: it runs before any check.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

# linux/sockios.h and linux/if.h: read and set an interface's flags; IFF_UP brings it up.
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
    """A new network namespace starts with its loopback down; ``ip link set lo up`` without iproute2."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(sock, SIOCGIFFLAGS, request)[:18])[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


def healthy(service: dict[str, Any]) -> bool:
    """Run the service's own healthcheck until it passes, as compose does before a dependant starts."""
    deadline = time.monotonic() + service["health_timeout"]
    while time.monotonic() < deadline:
        if service["proc"].poll() is not None:
            return False
        done = subprocess.run(service["health"], env=service["env"], capture_output=True, timeout=30)
        if done.returncode == 0:
            return True
        time.sleep(0.2)
    return False


def send(request: dict[str, Any]) -> dict[str, Any]:
    body = request["body"].encode() if request.get("body") is not None else None
    req = urllib.request.Request(
        request["url"], data=body, headers=request["headers"], method=request["method"]
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return {"status": resp.status, "headers": dict(resp.headers), "body": resp.read().decode()}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "headers": dict(exc.headers), "body": exc.read().decode()}


def main(plan_file: str) -> int:
    plan = json.loads(Path(plan_file).read_text())
    loopback_up()
    subprocess.run(["mount", "--bind", plan["hosts_file"], "/etc/hosts"], check=True)
    logs = Path(plan["logs"])
    result: dict[str, Any] = {"healthy": [], "responses": [], "exit_status": {}, "failed": None}
    started: list[dict[str, Any]] = []
    try:
        for service in plan["services"]:
            out = (logs / f"{service['name']}.log").open("w")
            service["proc"] = subprocess.Popen(
                service["argv"], env=service["env"], cwd=service["cwd"], stdout=out, stderr=subprocess.STDOUT
            )
            started.append(service)
            if not healthy(service):
                result["failed"] = service["name"]
                return 0
            result["healthy"].append(service["name"])
        result["responses"] = [send(request) for request in plan["requests"]]
    finally:
        for service in reversed(started):
            proc = service["proc"]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            result["exit_status"][service["name"]] = proc.returncode
        for service in started:
            result.setdefault("logs", {})[service["name"]] = (logs / f"{service['name']}.log").read_text()[
                -3000:
            ]
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main(sys.argv[1]))
