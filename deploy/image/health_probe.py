"""The cache server's liveness probe at the path LMCache's deployments run it from
(/workspace/LMCache/examples/kubernetes/health_probe.py HOST PORT): see
lmcache.cli.health_probe."""

import sys

from lmcache.cli.health_probe import main

sys.exit(main())
