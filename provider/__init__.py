"""The provider daemon: detects and benchmarks devices, advertises them, runs leased jobs."""
