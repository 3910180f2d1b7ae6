"""A worker spanning several ranks (tensor parallelism): rank 0 runs the engine, the others follow its steps."""
