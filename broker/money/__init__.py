"""Credits: the double-entry ledger and the holds a job's client pays from."""
