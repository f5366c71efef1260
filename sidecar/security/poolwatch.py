"""The prefill targets an InferencePool allows: the IP addresses of the pods it selects, followed
through the Kubernetes API (``SIDECAR_INFERENCE_POOL=namespace/name``).

1. Find the pool: a list of ``inferencepools`` named ``name`` in ``inference.networking.k8s.io/v1``,
   else — a 404: that API is not installed, or no pool of that name is in it — in the older
   ``inference.networking.x-k8s.io/v1alpha2`` (``SIDECAR_INFERENCE_POOL_GROUP``: that group's
   only). Its selector: ``spec.selector.matchLabels`` (v1),
   ``spec.selector`` itself (v1alpha2, a plain map).
2. List the namespace's pods with that label selector: the allowed set is the addresses
   (``status.podIPs``, else ``status.podIP``) of those that run (``phase: Running``) and are not
   being deleted. Readiness does not count: the list says which targets are legal, not which are
   healthy (a prefill that fails is the fallback policy's business).
3. Watch both from the lists' resource versions, with bookmarks: every pod event updates the set
   at once; a pool event with another selector lists the pods again. A watch the API ends, or
   that breaks, is resumed from the last resource version seen, without a list; a 410 (that
   version is gone) lists again.

Until the first list of an existing pool's pods succeeded, ``synced`` is False: the guard refuses
every target the pool alone would allow and ``/ready`` is 503 with ``reason``. After it, a failing
API never empties the set: the last one seen stays in force (``last_error`` says why it may be
stale), retried with a doubling backoff. A pool that is deleted allows nothing, until it is
created again.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Callable
from ipaddress import IPv4Address, IPv6Address
from typing import Any

from sidecar.security.kube import (
    KubeBadResponse,
    KubeClient,
    KubeError,
    KubeGone,
    KubeRefused,
    WatchEvent,
)

logger = logging.getLogger("sidecar.security.poolwatch")

IPAddress = IPv4Address | IPv6Address
API_GROUPS = (
    ("inference.networking.k8s.io", "v1"),
    ("inference.networking.x-k8s.io", "v1alpha2"),
)
"""Where an InferencePool may be, in the order they are tried."""
WATCH_TIMEOUT_S = 300.0
"""How long each watch asks to last (``timeoutSeconds``) before it is renewed."""
MAX_PODS = 65536
"""Pods remembered at most; beyond it a pod is left out (and logged): a bound on memory."""


class InferencePoolWatch:
    def __init__(
        self,
        client: KubeClient | None,
        pool: str,
        *,
        retry_base_s: float,
        retry_max_s: float,
        watch_timeout_s: float = WATCH_TIMEOUT_S,
        on_error: Callable[[str], None] = lambda kind: None,
        on_change: Callable[[int], None] = lambda size: None,
        group: str | None = None,
    ) -> None:
        """``client`` None: there is no API to ask (not in a pod, no SIDECAR_KUBE_API_URL).
        ``group``: the API group to find the pool in (None: each of ``API_GROUPS`` in turn)."""
        self._client = client
        self._apis = tuple(api for api in API_GROUPS if not group or api[0] == group)
        if not self._apis:
            raise ValueError(f"no InferencePool API in the group {group}")
        self.pool = pool
        self._namespace, self._name = pool.split("/", 1)
        self._retry_base_s = retry_base_s
        self._retry_max_s = retry_max_s
        self._watch_timeout_s = watch_timeout_s
        self._on_error = on_error
        self._on_change = on_change
        self._api: tuple[str, str] | None = None
        self._pool_version: str | None = None
        self._selector: dict[str, str] | None = None
        self._pods_version: str | None = None
        self._pods: dict[str, frozenset[IPAddress]] = {}
        self.addresses: frozenset[IPAddress] = frozenset()
        self.synced = False
        """The first list of the pool's pods succeeded."""
        self.exists = False
        self.last_sync: float | None = None
        self.last_event: float | None = None
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.errors = 0
        self._failures = 0

    # --- what the guard and /ready read ----------------------------------------------------

    @property
    def name(self) -> str:
        return f"the InferencePool {self.pool}"

    def allows(self, address: IPAddress) -> bool:
        return address in self.addresses

    @property
    def reason(self) -> str:
        """Why the pool is not synced yet, for ``/ready`` and the 403."""
        if self._client is None:
            return (
                f"{self.name} cannot be followed: no Kubernetes API (KUBERNETES_SERVICE_HOST is "
                "unset and SIDECAR_KUBE_API_URL empty)"
            )
        if self._api is not None and not self.exists:
            return f"{self.name} does not exist (looked up in {'/'.join(self._api)})"
        why = f": {self.last_error}" if self.last_error else ""
        return f"{self.name} has not been listed yet{why}"

    def snapshot(self) -> dict[str, Any]:
        """The ``inference_pool`` section of ``/debug/scheduler``."""
        return {
            "pool": self.pool,
            "api": "/".join(self._api) if self._api else None,
            "exists": self.exists,
            "selector": self._selector,
            "synced": self.synced,
            "addresses": sorted(str(a) for a in self.addresses),
            "pods": len(self._pods),
            "resource_versions": {"pool": self._pool_version, "pods": self._pods_version},
            "last_sync": self.last_sync,
            "last_event": self.last_event,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "errors": self.errors,
        }

    # --- following the API ----------------------------------------------------------------

    async def run(self) -> None:
        """Follow the pool forever; cancelled at shutdown."""
        if self._client is None:
            logger.error("%s", self.reason)
            return
        while True:
            try:
                if self._pool_version is None:
                    await self._list_pool(self._client)
                if self._pods_version is None and self._selector is not None:
                    await self._list_pods(self._client)
                await self._watch(self._client)
            except KubeError as exc:
                self._error(exc)
                await asyncio.sleep(self._backoff())

    def _backoff(self) -> float:
        self._failures = min(self._failures + 1, 32)  # 2 ** 31 × the base: past any maximum
        return min(self._retry_max_s, self._retry_base_s * 2.0 ** (self._failures - 1))

    def _error(self, exc: KubeError) -> None:
        self.errors += 1
        self.last_error, self.last_error_at = exc.message, time.time()
        self._on_error(exc.kind)
        if self.synced:
            logger.warning("%s: %s; the last %d addresses stay allowed", self.name, exc.message,
                           len(self.addresses))  # fmt: skip
        else:
            logger.warning("%s: %s; no target it selects is allowed yet", self.name, exc.message)

    def _ok(self) -> None:
        self._failures = 0
        self.last_event = time.time()

    def _collection(self, api: tuple[str, str]) -> str:
        group, version = api
        return f"/apis/{group}/{version}/namespaces/{self._namespace}/inferencepools"

    async def _list_pool(self, client: KubeClient) -> None:
        found = None
        for api in self._apis:
            try:
                answer = await client.get(self._collection(api), self._pool_query())
            except KubeRefused as exc:
                if exc.status == 404:
                    continue  # that API is not installed
                raise
            items = answer.get("items")
            version = _version_of(answer)
            if not isinstance(items, list) or version is None:
                raise KubeBadResponse(f"the list of InferencePools in {'/'.join(api)} has no items")
            if items or found is None:
                found = (api, items, version)
            if items:
                break
        if found is None:
            raise KubeRefused(
                f"no InferencePool API: {' nor '.join('/'.join(a) for a in self._apis)} "
                "is not served (is the CRD installed?)",
                404,
            )
        api, items, version = found
        self._api, self._pool_version = api, version
        self._ok()
        self._pool_changed(items[0] if items else None)

    def _pool_query(self) -> dict[str, str]:
        return {"fieldSelector": f"metadata.name={self._name}"}

    def _pool_changed(self, pool: dict[str, Any] | None) -> None:
        """The pool as it is now (None: deleted, or not there): a new selector lists the pods
        again."""
        if pool is None:
            if self.exists or self._selector is not None:
                logger.warning("%s does not exist: no target is allowed by it", self.name)
            self.exists = False
            self._selector, self._pods_version = None, None
            self._replace_pods({})
            return
        self.exists = True
        selector = _selector_of(pool, self._api)
        if selector != self._selector:
            if self._selector is not None:
                logger.info("%s: its selector is now %s", self.name, _label_query(selector))
            self._selector, self._pods_version = selector, None
        if selector is None:  # it selects nothing: there are no pods to list
            if not self.synced:
                logger.warning("%s has no label selector: it allows nothing", self.name)
            self._replace_pods({})
            self._listed()

    async def _list_pods(self, client: KubeClient) -> None:
        assert self._selector is not None
        path = f"/api/v1/namespaces/{self._namespace}/pods"
        answer = await client.get(path, {"labelSelector": _label_query(self._selector)})
        items, version = answer.get("items"), _version_of(answer)
        if not isinstance(items, list) or version is None:
            raise KubeBadResponse("the list of pods has no items or no resourceVersion")
        pods = {}
        for pod in items:
            name = _name_of(pod)
            if name is not None:
                pods[name] = _addresses(pod)
        self._pods_version = version
        self._replace_pods(pods)
        self._ok()
        self._listed()

    def _listed(self) -> None:
        if not self.synced:
            logger.info("%s: %d addresses allowed", self.name, len(self.addresses))
        self.synced, self.last_sync = True, time.time()

    async def _watch(self, client: KubeClient) -> None:
        """Both watches at once, until one of them needs a list (selector changed, 410) or
        fails; the other is then stopped, to resume from its resource version."""
        watches = [asyncio.create_task(self._watch_pool(client), name="inference-pool-watch")]
        if self._selector is not None:
            watches.append(asyncio.create_task(self._watch_pods(client), name="pods-watch"))
        try:
            done, _ = await asyncio.wait(watches, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in watches:
                task.cancel()
            await asyncio.gather(*watches, return_exceptions=True)
        for task in done:
            task.result()  # raises its KubeError

    async def _watch_pool(self, client: KubeClient) -> None:
        assert self._api is not None
        selector = self._selector
        try:
            while True:
                params = {**self._pool_query(), "allowWatchBookmarks": "true"}
                params["resourceVersion"] = self._pool_version or ""
                watch = client.watch(
                    self._collection(self._api), params, timeout_s=self._watch_timeout_s
                )
                async with contextlib.aclosing(watch) as events:  # closed when we return early
                    async for event in events:
                        self._pool_version = _version_of(event.object) or self._pool_version
                        self._ok()
                        if event.type in ("ADDED", "MODIFIED"):
                            self._pool_changed(event.object)
                        elif event.type == "DELETED":
                            self._pool_changed(None)
                        if self._selector != selector:
                            return  # the pods are listed again, with the new selector
        except KubeGone as exc:
            self._error(exc)
            self._pool_version = None

    async def _watch_pods(self, client: KubeClient) -> None:
        assert self._selector is not None
        path = f"/api/v1/namespaces/{self._namespace}/pods"
        try:
            while True:
                params = {
                    "labelSelector": _label_query(self._selector),
                    "allowWatchBookmarks": "true",
                    "resourceVersion": self._pods_version or "",
                }
                watch = client.watch(path, params, timeout_s=self._watch_timeout_s)
                async with contextlib.aclosing(watch) as events:
                    async for event in events:
                        self._pod_event(event)
        except KubeGone as exc:
            self._error(exc)
            self._pods_version = None

    def _pod_event(self, event: WatchEvent) -> None:
        self._pods_version = _version_of(event.object) or self._pods_version
        self._ok()
        if event.type == "BOOKMARK":
            return
        name = _name_of(event.object)
        if name is None:
            return
        pods = dict(self._pods)
        if event.type == "DELETED":
            pods.pop(name, None)
        elif event.type in ("ADDED", "MODIFIED"):
            if name not in pods and len(pods) >= MAX_PODS:
                logger.error("%s selects over %d pods: %s left out", self.name, MAX_PODS, name)
                return
            pods[name] = _addresses(event.object)
        self._replace_pods(pods)

    def _replace_pods(self, pods: dict[str, frozenset[IPAddress]]) -> None:
        if len(pods) > MAX_PODS:
            logger.error("%s selects %d pods: only %d are kept", self.name, len(pods), MAX_PODS)
            pods = dict(list(pods.items())[:MAX_PODS])
        self._pods = pods
        addresses = frozenset().union(*pods.values()) if pods else frozenset()
        if addresses != self.addresses:
            self.addresses = addresses
            self._on_change(len(addresses))
            logger.debug("%s: allowed %s", self.name, sorted(map(str, addresses)))


def _version_of(answer: dict[str, Any]) -> str | None:
    metadata = answer.get("metadata")
    version = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
    return version if isinstance(version, str) and version else None


def _name_of(obj: Any) -> str | None:
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    name = metadata.get("name") if isinstance(metadata, dict) else None
    return name if isinstance(name, str) and name else None


def _selector_of(pool: dict[str, Any], api: tuple[str, str] | None) -> dict[str, str] | None:
    """The pool's label selector; None when it has none a pod could match (nothing selected:
    an empty selector would select every pod of the namespace)."""
    spec = pool.get("spec")
    selector = spec.get("selector") if isinstance(spec, dict) else None
    if api is not None and api[1] == "v1" and isinstance(selector, dict):
        selector = selector.get("matchLabels")
    if not isinstance(selector, dict) or not selector:
        return None
    return {str(key): str(value) for key, value in sorted(selector.items())}


def _label_query(selector: dict[str, str] | None) -> str:
    return ",".join(f"{key}={value}" for key, value in (selector or {}).items())


def _addresses(pod: dict[str, Any]) -> frozenset[IPAddress]:
    """The addresses of a pod that may be called: running and not being deleted."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if not isinstance(metadata, dict) or not isinstance(status, dict):
        return frozenset()
    if metadata.get("deletionTimestamp") or status.get("phase") != "Running":
        return frozenset()
    listed = [entry.get("ip") for entry in status.get("podIPs") or [] if isinstance(entry, dict)]
    found = set()
    for text in listed or [status.get("podIP")]:
        if isinstance(text, str):
            try:
                found.add(ipaddress.ip_address(text))
            except ValueError:
                continue
    return frozenset(found)
