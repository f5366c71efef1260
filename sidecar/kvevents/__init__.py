"""What the engines say they hold: vLLM's KV-cache events (issue 26).

``events`` holds the decoded events, the same for both of vLLM's encodings; the wire, the
subscriber and the exact prefix index build on it.
"""
