"""A provider whose artifact uploads fail for a while, for the tests of array outputs only
(never part of the package): the real provider daemon, whose uploads (one blob, or many
small ones in one call) are refused as a throttled broker refuses them, from its first
upload on for FLAKY_FOR_S seconds.

    python -m tests.flaky_provider run --broker ... (the gpumarket-provider arguments)
"""

from __future__ import annotations

import os
import time

from gpumarket.kinds import arrays
from gpumarket.proto.errors import ResourceExhausted
from gpumarket.provider import daemon
from gpumarket.provider.cli import main

FOR_S = float(os.environ.get("FLAKY_FOR_S", "4"))
_first: list[float] = []


def _refuse() -> None:
    now = time.monotonic()
    if not _first:
        _first.append(now)
    if now - _first[0] < FOR_S:
        raise ResourceExhausted("more than 5 calls a second from this key; slow down"
                                " (tests/flaky_provider.py)")


def flaky(real):
    async def call(self, *args, **kwargs):
        _refuse()
        return await real(self, *args, **kwargs)
    return call


# Its outputs take the upload path, however small (the path being tested), not the task
# results update that carries small outputs.
arrays.INLINE_OUTPUT_BYTES = 0
daemon.ProviderDaemon.upload = flaky(daemon.ProviderDaemon.upload)
if hasattr(daemon.ProviderDaemon, "upload_blobs"):
    daemon.ProviderDaemon.upload_blobs = flaky(daemon.ProviderDaemon.upload_blobs)

if __name__ == "__main__":
    main()
