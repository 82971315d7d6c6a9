"""Roles a node can run: trainer, sampler, bootstrap. Each registers its protocols and runs its loops."""
