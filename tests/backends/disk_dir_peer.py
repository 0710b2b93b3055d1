"""One process of tests/backends/test_disk_claim.py: a disk tier over a shared directory,
as one tensor-parallel rank of a vLLM worker opens it.

    python tests/backends/disk_dir_peer.py PATH CAPACITY RANK

Opens the tier (its books, eviction and the disk backend seen through its object view,
as an engine does), prints ``READY``; then for each line on stdin:

- ``PUT A B``: stores this rank's chunks ``A`` to ``B - 1``; prints ``OK <n>``, the
  number of them stored;
- ``PAUSE I``: stores chunk ``I`` but stops after its temporary file is written, prints
  ``TMP <path>``, waits for the line ``GO``, finishes the store and prints ``OK 1`` (or
  ``ERR <why>`` if the store failed);
- ``KEYS``: prints ``KEYS <i> <j> ...``, the chunks of this rank the tier holds.

Exits (closing the tier) when stdin closes.
"""

from __future__ import annotations

import sys

from lmcache.config import load_config
from lmcache.hierarchy import build_tier
from lmcache.keys import CacheKey
from lmcache.testing.conformance import make_obj

#: tokens per chunk: each entry is 32 KiB of float16 plus its header
TOKENS = 256


def key(rank: int, i: int) -> str:
    return CacheKey("test", "org/model", f"float16-L2-H2-D8-lt2hd-tp{rank}of2", f"{i:032x}").to_string()


def main() -> None:
    path, capacity, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg = load_config({"tiers": [{"backend": "disk", "path": path, "capacity": capacity}]})
    tier = build_tier(0, cfg.tiers[0])
    store = tier.backend.raw  # the disk store under the view the tier opened
    write_file = store._write_file

    def paused(tmp, buffers, total):  # the real write, then a stop before the rename
        write_file(tmp, buffers, total)
        print(f"TMP {tmp}", flush=True)
        if sys.stdin.readline().strip() != "GO":
            raise SystemExit("expected GO")

    print("READY", flush=True)
    try:
        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd == "PUT":
                a, b = int(args[0]), int(args[1])
                stored = sum(bool(tier.put_one(key(rank, i), make_obj(i, TOKENS))) for i in range(a, b))
                print(f"OK {stored}", flush=True)
            elif cmd == "PAUSE":
                store._write_file = paused
                try:
                    stored = tier.put_one(key(rank, int(args[0])), make_obj(0, TOKENS))
                finally:
                    store._write_file = write_file
                print(f"OK {int(bool(stored))}" if stored else f"ERR {tier.stats.last_error}", flush=True)
            elif cmd == "KEYS":
                held = sorted(int(k.rsplit(":", 1)[1], 16) for k, _ in tier.keys() if f"tp{rank}of2" in k)
                print("KEYS " + " ".join(map(str, held)), flush=True)
    finally:
        tier.backend.close()


if __name__ == "__main__":
    main()
