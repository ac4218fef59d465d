"""Jobs and their leases as rows: the transitions of a job (submit, lease, checkpoint, release,
fail, cancel), job arrays' tasks, the read views, and job logs."""
