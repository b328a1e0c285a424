"""Local runs: `atoll up`, its processes, progress and report."""
