"""Names of files a service writes into the run directory for the controller to read back."""

LEARNER_ROWS = "learner_rows.jsonl"
"""``{run_dir}/learner_rows.jsonl``: every step's metrics row as the learner produced it (one JSON object per line,
flushed before the next step; a re-trained step appends again, the later line wins). The driver writes the rows of
``metrics.jsonl``; this copy lets a new driver write the rows of steps a learner finished while no driver was
running (``services.control.outputs.report.recover_rows``)."""
