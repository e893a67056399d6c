from sidecar.cli import run

run()
