"""A Redis Cluster on loopback for tests and benchmarks: ``masters`` masters with one replica each,
every node its own ``redis-server --cluster-enabled yes`` process on the shared launcher
(devkit/processes.py), joined by ``redis-cli --cluster create``."""

from __future__ import annotations

import asyncio
import functools
import shutil
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from devkit.processes import Child, Launcher, free_port, tcp_open


def installed(name: str, package: str) -> str:
    """The path of program ``name`` (from the Debian package ``package``)."""
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed (apt-get install {package})")
    return path


CLUSTER_BUS_OFFSET = 10000
"""A cluster node also listens on its port + 10000 (the cluster bus)."""


def free_cluster_port() -> int:
    """A free loopback port whose cluster-bus port (+ 10000) is free too."""
    while True:
        port = free_port()
        if port + CLUSTER_BUS_OFFSET > 65535:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))
            except OSError:
                continue
        return port


class RedisCluster:
    """A Redis Cluster: ``masters`` masters with one replica each (the module's docstring)."""

    def __init__(
        self,
        masters: int = 3,
        *,
        node_timeout_ms: int = 2000,
        find: Callable[[str, str], str] = installed,
    ) -> None:
        """``find(program, package)``: the path of ``redis-server`` and ``redis-cli``."""
        self._find = find
        self.node_timeout_ms = node_timeout_ms
        self.ports = [free_cluster_port() for _ in range(2 * masters)]
        self._launcher = Launcher(prefix="pd-sidecar-cluster-")
        self._nodes: dict[int, Child] = {}

    def url(self, port: int) -> str:
        return f"redis://127.0.0.1:{port}/0"

    async def start(self) -> None:
        server = self._find("redis-server", "redis-server")
        cli = self._find("redis-cli", "redis-tools")
        directory = str(self._launcher.log_dir)
        for port in self.ports:
            argv = [
                server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms), "--dir", directory,
            ]  # fmt: skip
            self._nodes[port] = self._launcher.spawn(f"redis-{port}", argv)
        for port, node in self._nodes.items():
            await node.wait_ready(functools.partial(tcp_open, "127.0.0.1", port), timeout_s=10)
        create = await asyncio.create_subprocess_exec(
            cli, "--cluster", "create", *(f"127.0.0.1:{port}" for port in self.ports),
            "--cluster-replicas", "1", "--cluster-yes",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await asyncio.wait_for(create.communicate(), 60)
        if create.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{output.decode()}")
        await self.until(self._formed, within=30)

    async def _formed(self) -> bool:
        """Every node says the cluster is ok and knows every other, each master serving slots
        with one replica attached and in sync."""
        for port in self.ports:
            info = await self.command(port, "CLUSTER", "INFO")
            if "cluster_state:ok" not in info:
                return False
            nodes = await self.nodes(port)
            replicas = [n for n in nodes if "slave" in n["flags"]]
            if len(nodes) != len(self.ports) or len(replicas) != len(self.ports) // 2:
                return False
            if any("fail" in n["flags"] or n["link"] != "connected" for n in nodes):
                return False
            role = await self.command(port, "ROLE")
            if role[0] == b"slave" and role[3] != b"connected":
                return False
        return True

    async def command(self, port: int, *args: str) -> Any:
        """One command to one node (not through the cluster); its decoded reply."""
        client = aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=2)
        try:
            reply = await client.execute_command(*args)  # type: ignore[no-untyped-call]
        finally:
            await client.aclose()
        return reply.decode() if isinstance(reply, bytes) else reply

    async def nodes(self, port: int) -> list[dict[str, Any]]:
        """``CLUSTER NODES`` as one node sees it: id, port, flags, master id, link, slots."""
        parsed = []
        for line in str(await self.command(port, "CLUSTER", "NODES")).splitlines():
            fields = line.split()
            parsed.append(
                {
                    "id": fields[0],
                    "port": int(fields[1].split("@")[0].rsplit(":", 1)[1]),
                    "flags": set(fields[2].split(",")),
                    "master": fields[3],
                    "link": fields[7],
                    "slots": fields[8:],
                }
            )
        return parsed

    async def slot_owner(self, key: str) -> tuple[int, int]:
        """The ports of the master serving ``key``'s slot and of its replica."""
        slot = int(await self.command(self.ports[0], "CLUSTER", "KEYSLOT", key))
        nodes = await self.nodes(self.ports[0])
        for master in nodes:
            for span in master["slots"]:
                low, _, high = span.partition("-")
                if int(low) <= slot <= int(high or low):
                    [replica] = [n for n in nodes if n["master"] == master["id"]]
                    return master["port"], replica["port"]
        raise AssertionError(f"no node serves slot {slot}")

    async def is_master(self, port: int) -> bool:
        try:
            role = await self.command(port, "ROLE")
        except (OSError, aioredis.RedisError):
            return False
        return bool(role[0] == b"master")

    def kill(self, port: int) -> None:
        """SIGKILL: the node is gone at once, as in a crash."""
        self._nodes[port].kill()

    async def until(self, check: Callable[[], Awaitable[bool]], within: float) -> None:
        async with asyncio.timeout(within):
            # The condition lives in other processes: there is no event to await.
            while not await check():  # noqa: ASYNC110
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        await self._launcher.close()
