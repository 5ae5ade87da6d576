"""The run's summary table and HTML report."""
