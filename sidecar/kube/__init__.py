"""The project's own small reader of the API server: where it is and with what credentials
(`sidecar.kube.access`, standard library only), and one bounded GET (`sidecar.kube.client`)."""
