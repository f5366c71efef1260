"""Monitoring manifests: alerts, dashboard, PodMonitor, proven against promtool and Prometheus."""
