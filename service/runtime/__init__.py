"""What serves the models: settings, state, batcher and engine thread, loading, model control,
statistics and metrics."""
