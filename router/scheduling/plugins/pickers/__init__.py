"""Pickers: each orders the candidates from their summed weighted scores, best first."""
