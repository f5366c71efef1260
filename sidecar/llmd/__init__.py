"""llm-d's routing-sidecar flags, accepted: argv in, ``Settings`` overrides out.

A decode pod made for llm-d's sidecar (its model-service chart, its guides) runs it with flags
(``--port=8000 --vllm-port=8200 --connector=nixlv2 ...``); pd-sidecar is configured by
``SIDECAR_*`` variables. ``flags`` holds the table of llm-d's flags and reads argv with Go's
syntax; ``translate`` turns what it read into setting overrides, refusals and start-up notes
(docs/migrating-from-llm-d.md).
"""

from sidecar.llmd.flags import FLAGS, Flag, FlagError, help_rows, parse
from sidecar.llmd.goparse import go_duration, go_int
from sidecar.llmd.translate import Translation, translate

__all__ = [
    "FLAGS",
    "Flag",
    "FlagError",
    "Translation",
    "go_duration",
    "go_int",
    "help_rows",
    "parse",
    "translate",
]
