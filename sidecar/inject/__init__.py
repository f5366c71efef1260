"""``python -m sidecar.inject``: put pd-sidecar into decode workloads as a native sidecar.

The same injection as the kustomize component ``manifests/components/pd-sidecar/``, for manifests
that are not built with kustomize; it also moves the engine to its port, which a component cannot.
``template`` holds the injected definition (``sidecar.yaml``), ``pod`` the surgery on one pod spec,
``prestop`` the engine's one ``preStop`` handler, ``environment`` the sidecar's variables and their
check, ``documents`` the multi-document stream and which workloads it injects. docs/deploy.md is
the guide.
"""

from sidecar.inject.documents import Report, inject_text
from sidecar.inject.environment import EnvError
from sidecar.inject.pod import InjectError
from sidecar.inject.template import Options, defaults, render

__all__ = ["EnvError", "InjectError", "Options", "Report", "defaults", "inject_text", "render"]
