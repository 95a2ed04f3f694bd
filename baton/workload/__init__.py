"""What `baton bench` sends and `baton sim` replays: synthetic datasets, Mooncake traces, and
the result record both write (baton/workload/results.py). Torch-free."""
