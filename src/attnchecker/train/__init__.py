"""One readable training loop shared by the CLI, the demo and the benchmarks, and its data."""
