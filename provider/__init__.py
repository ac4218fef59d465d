"""The provider daemon: detects and benchmarks devices, advertises them, runs leased jobs."""

import os

# Every child the daemon starts execs at once (forkservers, sandbox helpers, kill_uid's
# shell); none uses gRPC. gRPC's fork handlers only get in the way there: with other threads
# in gRPC, a child could abort in them between fork and exec (ev_epoll1_linux.cc "Check
# failed: next_worker->state == KICKED"), so a job's processes could outlive a kill_uid.
# Read when grpc is imported, so set here, before any of the provider's modules import it.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
