"""A second opener of a disk directory for tests/backends/test_review3_disk.py, one that
is stopped in the middle of its start-up scan (as ``lmcache evict`` stopped with Ctrl-Z):

    python tests/backends/disk_review3_peer.py PATH CAPACITY

Opens a disk tier over PATH the way an engine or a CLI command does; when its scan of
the directory starts (under the directory's lock) it prints ``SCANNING`` and stops itself
with SIGSTOP. Once continued it finishes opening, prints ``READY``, and closes when stdin
closes.
"""

from __future__ import annotations

import os
import signal
import sys

from lmcache.backends.disk import DiskBackend
from lmcache.config import load_config
from lmcache.hierarchy import build_tier


def main() -> None:
    path, capacity = sys.argv[1], sys.argv[2]
    scan = DiskBackend._index_files

    def stopped_scan(self, listing):  # the real scan, after a stop while it holds the lock
        print("SCANNING", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        return scan(self, listing)

    DiskBackend._index_files = stopped_scan
    cfg = load_config({"tiers": [{"backend": "disk", "path": path, "capacity": capacity}]})
    tier = build_tier(0, cfg.tiers[0], trim=False)
    print("READY", flush=True)
    try:
        sys.stdin.read()
    finally:
        tier.backend.close()


if __name__ == "__main__":
    main()
