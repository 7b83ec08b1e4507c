"""Prefill/decode disaggregation: bootstrap rendezvous, KV senders and receivers."""
