"""The command line: superneurons plan | train | demo (the benchmarks: benchmarks/run.py)."""
