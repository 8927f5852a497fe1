"""A small internet in Linux network namespaces: a public LAN, and a private LAN behind a NAT router.

For the NAT test and `scripts/nat_check.py`. Layout (addresses are fixed; names carry a tag, e.g.
the pid, so that several labs can exist at once):

    public LAN 11.199.0.0/24 (a bridge in namespace `sw-TAG-lan`)
      sw-TAG-boot   11.199.0.1    bootstrap node
      sw-TAG-pub    11.199.0.2    public peer, trainer
      sw-TAG-nat    11.199.0.3    NAT router (masquerades the private LAN, drops new inbound connections)
                    192.168.199.1
    private LAN 192.168.199.0/24
      sw-TAG-priv   192.168.199.2 peer behind NAT (default route via the router)

Every interface lives inside the lab's namespaces: both ends of every veth pair are moved out of the
root namespace as soon as they are made, and nothing else of the host's network is touched.
Needs root, `ip` (iproute2) and `iptables`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

# The lab's "internet" has public addresses (sealed off in the lab's namespaces, they never reach the
# real one): libp2p takes a relay at a private address for useless to a peer behind NAT, and never
# announces a relayed address through it.
PUBLIC_NET = "11.199.0"
PRIVATE_NET = "192.168.199"


class LabUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the message says why (for a test's skip reason)."""


def _run(command: Sequence[str]) -> None:
    result = subprocess.run(list(command), capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, command, result.stdout, result.stderr)


@dataclass
class NatLab:
    """The namespaces of one lab: `build()` makes them, `destroy()` removes all of them."""

    tag: str
    namespaces: list[str] = field(default_factory=list)

    def name(self, role: str) -> str:
        return f"sw-{self.tag}-{role}"

    @property
    def bootstrap_ip(self) -> str:
        return f"{PUBLIC_NET}.1"

    @property
    def public_ip(self) -> str:
        return f"{PUBLIC_NET}.2"

    @property
    def router_ip(self) -> str:
        return f"{PUBLIC_NET}.3"

    @property
    def private_ip(self) -> str:
        return f"{PRIVATE_NET}.2"

    def exec_prefix(self, role: str) -> list[str]:
        """The command prefix that runs a program in the namespace of `role` (boot, pub, nat or priv)."""
        return ["ip", "netns", "exec", self.name(role)]

    def run_in(self, role: str, *command: str) -> None:
        _run([*self.exec_prefix(role), *command])

    def build(self) -> None:
        """Makes the namespaces, links and NAT rules; raises LabUnavailable where this host cannot."""
        if os.geteuid() != 0:
            raise LabUnavailable("network namespaces need root")
        for tool in ("ip", "iptables"):
            if shutil.which(tool) is None:
                raise LabUnavailable(f"`{tool}` is not installed")
        try:
            self._add_namespace("lan")
        except (subprocess.CalledProcessError, OSError) as e:
            raise LabUnavailable(f"`ip netns add` failed: {getattr(e, 'stderr', '') or e}".strip()) from None
        try:
            self._build_links()
        except subprocess.CalledProcessError as e:
            self.destroy()
            raise LabUnavailable(f"`{' '.join(e.cmd)}` failed: {e.stderr.strip()}") from None

    def _add_namespace(self, role: str) -> None:
        _run(["ip", "netns", "add", self.name(role)])
        self.namespaces.append(self.name(role))
        self.run_in(role, "ip", "link", "set", "lo", "up")

    def _veth(self, left_role: str, left: str, right_role: str, right: str) -> None:
        """A veth pair made directly inside two lab namespaces (never in the root namespace)."""
        _run(
            ["ip", "link", "add", left, "netns", self.name(left_role), "type", "veth", "peer", "name", right]
            + ["netns", self.name(right_role)]
        )

    def _build_links(self) -> None:
        for role in ("boot", "pub", "nat", "priv"):
            self._add_namespace(role)
        self.run_in("lan", "ip", "link", "add", "br0", "type", "bridge")
        self.run_in("lan", "ip", "link", "set", "br0", "up")
        for role, ip in (("boot", self.bootstrap_ip), ("pub", self.public_ip), ("nat", self.router_ip)):
            self._veth("lan", f"to-{role}", role, "eth0")
            self.run_in("lan", "ip", "link", "set", f"to-{role}", "master", "br0")
            self.run_in("lan", "ip", "link", "set", f"to-{role}", "up")
            self.run_in(role, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
            self.run_in(role, "ip", "link", "set", "eth0", "up")
        self._veth("nat", "eth1", "priv", "eth0")
        self.run_in("nat", "ip", "addr", "add", f"{PRIVATE_NET}.1/24", "dev", "eth1")
        self.run_in("nat", "ip", "link", "set", "eth1", "up")
        self.run_in("priv", "ip", "addr", "add", f"{self.private_ip}/24", "dev", "eth0")
        self.run_in("priv", "ip", "link", "set", "eth0", "up")
        self.run_in("priv", "ip", "route", "add", "default", "via", f"{PRIVATE_NET}.1")
        # a home router: the private LAN goes out under the router's address, and nothing from
        # outside gets in unless it answers a connection made from inside
        self.run_in("nat", "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        self.run_in(
            "nat", "iptables", "-t", "nat", "-A", "POSTROUTING", "-s", f"{PRIVATE_NET}.0/24", "-o", "eth0",
            "-j", "MASQUERADE",
        )  # fmt: skip
        self.run_in(
            "nat", "iptables", "-A", "FORWARD", "-i", "eth0", "-o", "eth1", "-m", "conntrack",
            "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT",
        )  # fmt: skip
        self.run_in("nat", "iptables", "-A", "FORWARD", "-i", "eth0", "-o", "eth1", "-j", "DROP")

    def destroy(self) -> None:
        """Removes every namespace of the lab (their interfaces go with them)."""
        for namespace in reversed(self.namespaces):
            with contextlib.suppress(subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired):
                _run(["ip", "netns", "del", namespace])
        self.namespaces.clear()
