"""skyrl metrics loggers: one module per logger, each its own plugin (entry point)."""
