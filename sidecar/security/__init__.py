"""What keeps a client from steering the sidecar: which prefill targets a header may name
(``trust``: the SSRF allowlist, DNS-pinned), the allowlist that follows an InferencePool
(``poolwatch``) and its small Kubernetes API client (``kube``), and the TLS contexts of the
listener and the engine clients (``tls``)."""
