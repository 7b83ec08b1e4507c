"""Launching topologies: plans now; spawning, readiness and teardown come with `pdctl up`."""
