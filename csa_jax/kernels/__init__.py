"""Kernel packages, one per Pallas dialect (each an impl module; see csa_jax/registry.py)."""
