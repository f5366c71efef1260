"""The server around the request path: client connections and their bounds (``listener``), the
probes and views beside the generation routes (``admin``), serving the application on its ports
and shutting it down (``runner``, ``drain``), and aiohttp's server log (``serverlog``)."""
