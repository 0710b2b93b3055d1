"""The image's tests (tests/image) run in `make test-image` only, with LMCACHE_IMAGE_TESTS=1,
after `make image` built the image: the main suite (testpaths = tests) leaves them out."""

import os

collect_ignore_glob = [] if os.environ.get("LMCACHE_IMAGE_TESTS") == "1" else ["test_*.py"]
