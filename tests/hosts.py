"""Hosts for the tests: network namespaces joined by a bridge (`ip netns`, as root), each with its own loopback and one
interface, eth0, at 198.18.0.<n> (RFC 2544's range for network tests): what one machine's loopback cannot show (an
address published as 127.0.0.1 reaches nobody; a host's name resolves to loopback). Where namespaces cannot be made,
the same tests run on this machine's loopback (`Loopback`), and say so.

Every process started on a host carries STARTER_TEST_HOST in its environment, and so does every process it starts
(a lighthouse in a session of its own too): losing a host kills each of them."""

import os
import signal
import subprocess
import uuid
from pathlib import Path

MARK = "STARTER_TEST_HOST"


class Loopback:
    """Hosts that are this machine: every address 127.0.0.1."""

    on_loopback = True

    def __init__(self, count: int):
        self.names = [f"{uuid.uuid4().hex[:8]}-{n}" for n in range(count)]

    def address(self, host: int) -> str:
        return "127.0.0.1"

    def command(self, host: int, argv: list[str]) -> list[str]:
        return list(argv)

    def popen(self, host: int, argv: list[str], env: dict, **kwargs) -> subprocess.Popen:
        """`argv` started on `host`, its environment `env` and the host's mark."""
        return subprocess.Popen(self.command(host, argv), env={**env, MARK: self.names[host]}, **kwargs)

    def run(self, host: int, argv: list[str], env: dict, timeout: float = 120) -> str:
        """`argv` run on `host` to its end (it must succeed); its output."""
        done = self.popen(host, argv, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = done.communicate(timeout=timeout)
        assert done.returncode == 0, out[-3000:]
        return out

    def pids(self, host: int) -> list[int]:
        return marked(self.names[host])

    def kill(self, host: int) -> None:
        """The host lost: every process on it SIGKILLed at once."""
        for pid in self.pids(host):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        for host in range(len(self.names)):
            self.kill(host)


class Namespaces(Loopback):
    """Hosts that are network namespaces on one bridge (itself in a namespace of its own: nothing of this machine's
    network changes)."""

    on_loopback = False

    def __init__(self, count: int):
        super().__init__(count)
        self.lan = f"lan-{self.names[0]}"
        made = [self.lan]
        try:
            ip("netns", "add", self.lan)
            ip("-n", self.lan, "link", "add", "br0", "type", "bridge")
            ip("-n", self.lan, "link", "set", "br0", "up")
            for n, name in enumerate(self.names):
                ip("netns", "add", name)
                made.append(name)
                ip("-n", self.lan, "link", "add", f"v{n}", "type", "veth", "peer", "name", "eth0", "netns", name)
                ip("-n", self.lan, "link", "set", f"v{n}", "master", "br0", "up")
                ip("-n", name, "addr", "add", f"{self.address(n)}/24", "dev", "eth0")
                ip("-n", name, "link", "set", "eth0", "up")
                ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            for name in made:
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
            raise

    def address(self, host: int) -> str:
        return f"198.18.0.{host + 1}"

    def command(self, host: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[host], *argv]

    def pids(self, host: int) -> list[int]:
        listed = subprocess.run(["ip", "netns", "pids", self.names[host]], capture_output=True, text=True).stdout
        return sorted({*map(int, listed.split()), *marked(self.names[host])})

    def close(self) -> None:
        super().close()
        for name in [*self.names, self.lan]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def marked(name: str) -> list[int]:
    """The processes whose environment carries the host mark `name`."""
    found, mark = [], f"{MARK}={name}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def make_hosts(count: int) -> tuple[Loopback, str | None]:
    """`count` hosts of network namespaces, else of this machine's loopback with the reason they are not."""
    try:
        return Namespaces(count), None
    except (OSError, subprocess.CalledProcessError) as err:
        said = getattr(err, "stderr", None) or str(err)
        return Loopback(count), f"network namespaces cannot be made here ({' '.join(said.split())[:120]})"
