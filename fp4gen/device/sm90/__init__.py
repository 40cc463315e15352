"""Hopper (sm_90a) kernel classes: ``forward`` (attention forward), ``backward`` (its gradients)."""
