"""hami-sidecar: registration health of device plugins, for the livenessProbe, operators and Prometheus."""

__version__ = "0.1.0"
