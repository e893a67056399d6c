"""Coverage-guided fuzzing of the parsers that read the node (`make fuzz`, fuzz/run.py)."""
