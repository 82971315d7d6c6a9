"""Trainer side: torch + transformers policy, GRPO, verified rollouts, publishing versions, tasks."""
