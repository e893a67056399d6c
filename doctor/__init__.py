"""hami-doctor: why does this node show no GPU resource, and what fixes it.

One run gathers the evidence (`evidence`: initcheck's checks and the sidecar's probes,
the same code, plus logs, processes and versions), judges every known root cause from
it (`causes`, pure), plans the safe repairs (`repairs`) and prints the report
(`render`: text, JSON, node-problem-detector). `cli` joins them.

The imports run one way: settings → evidence → causes → repairs → render → cli. The
records they pass are in `types`, which imports no other module of the doctor; the log
lines the doctor knows are data (`patterns.toml`, loaded and checked by `patterns`), read
by the scanner `logscan`; the DRA drivers' part is one module per stage (`dra.evidence`,
`dra.causes`).
"""
