"""Device plugins: the evidence of registration (`probes`, `checkpoint`, `hamiconfig`) and its pure
verdicts (`verdicts`)."""
