"""Device plugins: the evidence of registration (`probes`, `checkpoint`, `hamiconfig`), the judge
(`verdicts`) and its rule families (docs/design.md#rule-families), and the round (`watch`)."""
