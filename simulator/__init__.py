"""`baton sim`: a fleet of real engines (the compiled scheduler in its mode, the real prefix
cache) over the model-free runner, in virtual time (simulator/fleet.py)."""
