"""The P:D planner: which split of a fixed engine budget serves the recent load best."""
