"""What a run leaves in its directory: metrics rows and plots (``report``), the resolved recipe and its one
reader (``run_dir``), the one-driver lock (``run_lock``) and the experiment trackers (``tracking``)."""
