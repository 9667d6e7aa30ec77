"""KV-cache events: wire codec, ordered application to the index, ZeroMQ subscriber."""
