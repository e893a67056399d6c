"""hami-doctor: why does this node show no GPU resource, and what fixes it.

One run gathers the evidence (`evidence`: initcheck's checks and the sidecar's probes,
the same code, plus logs, processes and versions), judges every known root cause from
it (`causes`, pure), plans the safe repairs (`repairs`) and prints the report
(`render`: text, JSON, node-problem-detector). `cli` joins them.
"""
