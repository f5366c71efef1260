"""What an operator sees of the sidecar: the ``pd_sidecar_*`` metrics (``metrics``), OpenTelemetry
spans (``tracing``; the SDK is imported only when it is on), every request's lifecycle record in
flight and in a bounded history (``tracking``), and the ``/debug/requests`` views and page
(``debug``, ``debug_page``; the page's files are ``sidecar/static/``)."""
