"""A fake Kubernetes API server for the InferencePool allowlist's tests: pods and InferencePools
(``inference.networking.k8s.io/v1`` and ``inference.networking.x-k8s.io/v1alpha2``), spoken to
with the real list and watch protocol, on a loopback port, over HTTPS.

What it implements, as the API server does:

- ``GET`` of a collection: ``{"kind": "...List", "metadata": {"resourceVersion"}, "items"}``,
  filtered by ``labelSelector`` (``key=value`` terms) and ``fieldSelector=metadata.name=...``.
- ``?watch=true``: a chunked ``application/json`` body, one event per line
  (``{"type": "ADDED" | "MODIFIED" | "DELETED" | "BOOKMARK" | "ERROR", "object": ...}``), from
  the ``resourceVersion`` given on: the retained history after it first, then live changes. An
  object that stops (starts) matching the selector is a ``DELETED`` (``ADDED``), as the API's
  watch cache sends. ``allowWatchBookmarks`` lets ``bookmark()`` send one. ``timeoutSeconds``
  ends the watch.
- One resource version counter for everything (etcd's); ``compact()`` forgets the history, so
  a watch from an older version gets ``410 Gone`` — an ``ERROR`` event with a ``Status`` of code
  410 by default, or the HTTP status itself (``gone_as_status``): the API does both.
- ``Authorization: Bearer <token>`` on every request (401 otherwise); a group that is not
  installed answers 404.

What the test controls: pods added, modified (address, phase, labels, being deleted) and
removed; pools set and deleted; watches dropped abruptly (``drop_watches``); the whole server
down (refusing connections, cutting those open) and up again on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import ssl
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from devkit.processes import free_port
from tests.tlsfiles import Pki

NAMESPACE = "llm"
V1 = "inference.networking.k8s.io/v1"
V1ALPHA2 = "inference.networking.x-k8s.io/v1alpha2"
HISTORY = 1000
"""Events retained for watches that resume (older ones: 410)."""
WATCH_QUEUE = 1000
"""Events a watch may fall behind by before the server drops it (as the API does)."""

Obj = dict[str, Any]


@dataclass(eq=False)  # each watch is its own: hashed by identity
class _Watch:
    resource: str
    namespace: str
    labels: dict[str, str]
    name: str | None
    bookmarks: bool
    request: web.Request
    queue: asyncio.Queue[Obj | None] = field(default_factory=lambda: asyncio.Queue(WATCH_QUEUE))


def pool_object(name: str, labels: dict[str, str], api: str) -> Obj:
    if api == V1:
        spec: Obj = {
            "selector": {"matchLabels": labels},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "pd-epp", "port": {"number": 9002}},
        }
    else:
        spec = {"selector": labels, "targetPortNumber": 8000, "extensionRef": {"name": "pd-epp"}}
    return {"apiVersion": api, "kind": "InferencePool", "metadata": {"name": name}, "spec": spec}


def pod_object(name: str, ip: str, labels: dict[str, str], phase: str = "Running") -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0"}]},
        "status": {
            "phase": phase,
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


class FakeKubernetes:
    def __init__(self, pki: Pki, *, token: str = "token-1", apis: tuple[str, ...] = (V1, V1ALPHA2)):
        self.token = token
        self.apis = set(apis)
        self.gone_as_status = False
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        cert, key, _ = pki.issue("127.0.0.1")
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(cert, key)
        self._version = 100
        self._objects: dict[tuple[str, str, str], Obj] = {}
        # (version, resource, namespace, type, object before, object after)
        self._history: deque[tuple[int, str, str, str, Obj | None, Obj]] = deque(maxlen=HISTORY)
        self._oldest = self._version
        """A watch may resume from this version or a later one."""
        self._watches: set[_Watch] = set()
        self._uids = itertools.count(1)
        self._down = False
        self.lists: Counter[str] = Counter()
        """Lists served, by resource (``pods``, ``inferencepools``)."""
        self.watches: Counter[str] = Counter()
        """Watches started, by resource."""
        self.watched_from: list[tuple[str, str]] = []
        """(resource, resourceVersion asked for) of every watch, in order."""
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None

    # --- the server ----------------------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application(middlewares=[self._refuse_when_down])
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        app.router.add_get("/apis/{group}/{version}/namespaces/{namespace}/inferencepools",
                           self._pools)  # fmt: skip
        # A connection cut (by drop_watches or down) cancels its watch's handler at once.
        self._runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=0.1, handler_cancellation=True
        )
        await self._runner.setup()
        await self.up()

    async def up(self) -> None:
        """Listen (again, on the same port)."""
        assert self._runner is not None
        self._down = False
        self._site = web.TCPSite(
            self._runner, "127.0.0.1", self.port, ssl_context=self._context, reuse_address=True
        )
        await self._site.start()

    async def down(self) -> None:
        """Refuse connections, and cut every one open (watches and keep-alive alike)."""
        self._down = True
        if self._site is not None:
            await self._site.stop()
            self._site = None
        self.drop_watches()

    async def close(self) -> None:
        self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _refuse_when_down(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        if self._down:  # a request on a connection that was open before
            if request.transport is not None:
                request.transport.abort()
            raise web.HTTPServiceUnavailable()
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return _status(401, "Unauthorized", "Unauthorized")
        response: web.StreamResponse = await handler(request)
        return response

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        return await self._collection(request, "pods", "PodList")

    async def _pools(self, request: web.Request) -> web.StreamResponse:
        api = f"{request.match_info['group']}/{request.match_info['version']}"
        if api not in self.apis:
            return _status(404, "NotFound", "the server could not find the requested resource")
        return await self._collection(request, f"inferencepools.{api}", "InferencePoolList")

    async def _collection(
        self, request: web.Request, resource: str, kind: str
    ) -> web.StreamResponse:
        namespace = request.match_info["namespace"]
        labels = _parse_labels(request.query.get("labelSelector", ""))
        name = _parse_name(request.query.get("fieldSelector", ""))
        if request.query.get("watch") in ("true", "1"):
            return await self._watch(request, resource, namespace, labels, name)
        self.lists[resource.split(".", 1)[0]] += 1
        items = [
            copy.deepcopy(obj)
            for (res, ns, _), obj in sorted(self._objects.items())
            if res == resource and ns == namespace and _matches(obj, labels, name)
        ]
        api = resource.split(".", 1)[1] if "." in resource else "v1"
        answer = {
            "apiVersion": api,
            "kind": kind,
            "metadata": {"resourceVersion": str(self._version)},
            "items": items,
        }
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    async def _watch(
        self,
        request: web.Request,
        resource: str,
        namespace: str,
        labels: dict[str, str],
        name: str | None,
    ) -> web.StreamResponse:
        self.watches[resource.split(".", 1)[0]] += 1
        since_text = request.query.get("resourceVersion", "")
        self.watched_from.append((resource.split(".", 1)[0], since_text))
        since = int(since_text) if since_text not in ("", "0") else None
        if since is not None and since < self._oldest and self.gone_as_status:
            return _status(410, "Expired", f"too old resource version: {since} ({self._oldest})")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        watch = _Watch(
            resource,
            namespace,
            labels,
            name,
            request.query.get("allowWatchBookmarks") == "true",
            request,
        )
        if since is not None and since < self._oldest:
            gone = _status_object(410, "Expired", f"too old resource version: {since}")
            await response.write(orjson.dumps({"type": "ERROR", "object": gone}) + b"\n")
            return response
        if since is None:  # from now on, the current objects first as ADDED
            for (res, ns, _), obj in sorted(self._objects.items()):
                if res == resource and ns == namespace and _matches(obj, labels, name):
                    watch.queue.put_nowait({"type": "ADDED", "object": copy.deepcopy(obj)})
        else:
            for version, res, ns, kind, before, after in self._history:
                if version > since and res == resource and ns == namespace:
                    event = _filtered(kind, before, after, labels, name)
                    if event is not None:
                        watch.queue.put_nowait(event)
        self._watches.add(watch)
        timeout_s = float(request.query.get("timeoutSeconds", "1800"))
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    event = await watch.queue.get()
                    if event is None:
                        break
                    await response.write(orjson.dumps(event) + b"\n")
        except TimeoutError:
            pass
        finally:
            self._watches.discard(watch)
        return response

    # --- what the test does ------------------------------------------------------------------

    def drop_watches(self) -> None:
        """Cut every watch connection abruptly (no end of the chunked body)."""
        for watch in list(self._watches):
            if watch.request.transport is not None:
                watch.request.transport.abort()
            _end(watch)
        self._watches.clear()

    def watching(self, resource: str) -> int:
        """Watches of ``resource`` (``pods``, ``inferencepools``) open now."""
        return sum(1 for w in self._watches if w.resource.split(".", 1)[0] == resource)

    def bookmark(self) -> None:
        """A BOOKMARK with the current resource version to every watch that allows them."""
        for watch in self._watches:
            if watch.bookmarks:
                kind = "Pod" if watch.resource == "pods" else "InferencePool"
                obj = {"kind": kind, "metadata": {"resourceVersion": str(self._version)}}
                self._send(watch, {"type": "BOOKMARK", "object": obj})

    def compact(self) -> None:
        """Forget the history: a watch from any version before now gets 410."""
        self._history.clear()
        self._oldest = self._version

    @property
    def resource_version(self) -> int:
        return self._version

    def set_pool(self, name: str, labels: dict[str, str], api: str = V1) -> None:
        self._put(f"inferencepools.{api}", name, pool_object(name, labels, api))

    def delete_pool(self, name: str, api: str = V1) -> None:
        self._delete(f"inferencepools.{api}", name)

    def add_pod(self, name: str, ip: str, labels: dict[str, str], phase: str = "Running") -> None:
        self._put("pods", name, pod_object(name, ip, labels, phase))

    def modify_pod(
        self,
        name: str,
        *,
        ip: str | None = None,
        labels: dict[str, str] | None = None,
        phase: str | None = None,
        deleting: bool = False,
    ) -> None:
        obj = copy.deepcopy(self._objects[("pods", NAMESPACE, name)])
        if ip is not None:
            obj["status"]["podIP"], obj["status"]["podIPs"] = ip, [{"ip": ip}]
        if labels is not None:
            obj["metadata"]["labels"] = labels
        if phase is not None:
            obj["status"]["phase"] = phase
        if deleting:
            obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        self._put("pods", name, obj)

    def delete_pod(self, name: str) -> None:
        self._delete("pods", name)

    def objects(self) -> list[Obj]:
        """Every object as stored (for validating their shapes)."""
        return [copy.deepcopy(obj) for obj in self._objects.values()]

    def _put(self, resource: str, name: str, obj: Obj) -> None:
        key = (resource, NAMESPACE, name)
        before = self._objects.get(key)
        self._version += 1
        obj = copy.deepcopy(obj)
        metadata = obj["metadata"]
        metadata["namespace"] = NAMESPACE
        metadata["resourceVersion"] = str(self._version)
        metadata["uid"] = (before or {}).get("metadata", {}).get("uid") or self._uid()
        metadata.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
        self._objects[key] = obj
        self._record(resource, "MODIFIED" if before else "ADDED", before, obj)

    def _delete(self, resource: str, name: str) -> None:
        before = self._objects.pop((resource, NAMESPACE, name))
        self._version += 1
        after = copy.deepcopy(before)
        after["metadata"]["resourceVersion"] = str(self._version)
        self._record(resource, "DELETED", before, after)

    def _uid(self) -> str:
        return f"00000000-0000-4000-8000-{next(self._uids):012d}"

    def _record(self, resource: str, kind: str, before: Obj | None, after: Obj) -> None:
        self._history.append((self._version, resource, NAMESPACE, kind, before, after))
        for watch in list(self._watches):
            if watch.resource == resource and watch.namespace == NAMESPACE:
                event = _filtered(kind, before, after, watch.labels, watch.name)
                if event is not None:
                    self._send(watch, event)

    def _send(self, watch: _Watch, event: Obj) -> None:
        try:
            watch.queue.put_nowait(event)
        except asyncio.QueueFull:  # a watch that fell too far behind is ended, as the API does
            self._watches.discard(watch)
            _end(watch)


def _end(watch: _Watch) -> None:
    """Its handler stops at the next event it takes (the queue makes room for the mark)."""
    if watch.queue.full():
        watch.queue.get_nowait()
    watch.queue.put_nowait(None)


def _parse_labels(text: str) -> dict[str, str]:
    terms = [term.split("=", 1) for term in text.split(",") if term]
    return {key: value for key, value in terms}


def _parse_name(text: str) -> str | None:
    return text.removeprefix("metadata.name=") if text.startswith("metadata.name=") else None


def _matches(obj: Obj | None, labels: dict[str, str], name: str | None) -> bool:
    if obj is None:
        return False
    metadata = obj["metadata"]
    if name is not None and metadata["name"] != name:
        return False
    return labels.items() <= (metadata.get("labels") or {}).items()


def _filtered(
    kind: str, before: Obj | None, after: Obj, labels: dict[str, str], name: str | None
) -> Obj | None:
    """The event a watch with this selector sees for a change, if any."""
    was, now = _matches(before, labels, name), _matches(after, labels, name)
    if kind == "DELETED":
        return {"type": "DELETED", "object": copy.deepcopy(after)} if was else None
    if was and now:
        return {"type": "MODIFIED", "object": copy.deepcopy(after)}
    if now:
        return {"type": "ADDED", "object": copy.deepcopy(after)}
    if was:
        return {"type": "DELETED", "object": copy.deepcopy(after)}
    return None


def _status_object(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _status(code: int, reason: str, message: str) -> web.Response:
    return web.Response(
        status=code,
        body=orjson.dumps(_status_object(code, reason, message)),
        content_type="application/json",
    )


@contextlib.asynccontextmanager
async def fake_kubernetes(pki: Pki, **options: Any) -> AsyncIterator[FakeKubernetes]:
    kube = FakeKubernetes(pki, **options)
    await kube.start()
    try:
        yield kube
    finally:
        await kube.close()
