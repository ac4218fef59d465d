"""The broker: keeps providers, jobs, leases and artifacts; matches jobs to providers."""
