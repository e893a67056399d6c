"""What the three programs share: the flag vocabulary (`flags`, `envflags`) and the readers of the node
(`node`). Standard library and psutil only, so the init image carries it whole."""
