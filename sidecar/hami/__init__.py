"""HAMi's own registration: the node's devices as HAMi's scheduler sees them (its Node annotations),
against what the kubelet lists (docs/design.md#hami-registration)."""
