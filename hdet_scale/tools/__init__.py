"""Tools around a run, apart from the algorithm: ``python -m hdet_scale.tools.report`` plots and summarizes metrics
files and exports the schedule a run discovered for a replay."""
