"""The attention debug API: slow-path weights, heatmaps, the debug page's files."""
