"""The engine: from a resolved config to a running job (``launch``, ``DefaultTrainer``, the trainer and its hooks)."""
