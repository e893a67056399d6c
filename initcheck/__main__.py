from initcheck.cli import run

run()
