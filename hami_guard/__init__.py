"""What the three programs share: the flag vocabulary (`flags`, `envflags`), the readers of the node
(`node`) and the vendor profiles (`profiles`). Standard library only, so the init image carries what
initcheck uses of it (all but the profiles)."""
