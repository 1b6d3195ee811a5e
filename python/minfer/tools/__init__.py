"""Tools that drive the engine: bench, perplexity, memory-bandwidth probe, model inspection."""
