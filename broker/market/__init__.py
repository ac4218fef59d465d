"""Who runs what: admission (a job's needs and estimate), offers and what the broker believes of
them (figures, reliability, standing, calibration), the matcher, and the scheduler that places
queued jobs and expires leases; providers' rows and heartbeats."""
