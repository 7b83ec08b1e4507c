"""Server roles: colocated (prefill and decode in one server) now; PD roles build on it."""
