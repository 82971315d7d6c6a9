"""The torch learner and nothing else: model, optimizer, GRPO loss, versions kept for scoring, tasks, the
embedded base model. Never imports node/ (node/ roles use this package, never the reverse); the modules a
sampler or the rollout intake need (tasks, groups, text, model_dir, errors) import no torch."""
