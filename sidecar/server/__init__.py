"""What the sidecar serves: the bounded HTTP listener (`serving`), the views (`views`), the metrics
(`metrics`)."""
