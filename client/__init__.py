"""The client: a typed broker client and the ``gpumarket`` CLI."""
