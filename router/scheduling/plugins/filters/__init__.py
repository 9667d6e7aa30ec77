"""Filters: each drops the candidates that may not take a request, with the reason."""
