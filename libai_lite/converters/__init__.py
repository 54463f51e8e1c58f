"""Model converters: what rewrites or wraps a model's modules in place without splitting it over ranks (float8
linears, activation checkpointing, torch.compile), applied per part by ``parallel.parallelize``."""
