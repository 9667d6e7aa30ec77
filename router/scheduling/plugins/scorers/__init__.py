"""Scorers: each prices every candidate left after the filters (a cost: lower is better)."""
