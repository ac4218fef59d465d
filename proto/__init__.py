"""The protocol every gpumarket role shares: schema, identities, signed envelopes, job specs."""

__version__ = "0.1.0"
