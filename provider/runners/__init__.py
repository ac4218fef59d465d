"""Job runners: each runs in its own child process (``python -m ... WORKDIR``)."""
