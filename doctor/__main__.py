"""`python -m doctor`: hami-doctor's command line."""

from doctor.cli import run

run()
