"""hami-initcheck: refuse to start a device plugin that could never register with the kubelet."""
