"""What every service process shares: serving, auth, HTTP, streams, the replica registry, tracing, metric sinks and process tuning."""
