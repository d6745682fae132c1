"""Tools that talk to a running kvserve through its public APIs: the load generator
(`bench`), the CLI client (`generate`), `fetch_model`, and the bare static loop baseline."""
