"""The embedded servers pdctl spawns: engine, model, KV, scheduler, TP, HTTP API, roles."""
