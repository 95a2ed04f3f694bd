"""Engine costs: the versioned profile `baton profile` writes (baton/perf/profile.py) and the
model-free runner that runs at its predicted speed (baton/perf/mock_runner.py). Torch-free."""
