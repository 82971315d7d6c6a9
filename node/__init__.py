"""swarmrl node: the one binary every participant runs, with a role (trainer, sampler, bootstrap)."""
