"""The controller's behaviour over the ``valkey`` index: the tests of test_controller.py
and test_controller_caps.py (which run over ``memory``) run again here, unchanged, with
``LMCACHE_CONTROLLER_INDEX`` naming a loopback Valkey standalone, a Redis primary behind a
Sentinel, and a three-master Valkey Cluster; every controller process they start (the
cluster's, the caps test's) inherits it.

Left out: test_controller_restart_heals_the_index, whose last step expects a restarted
controller to have forgotten a killed instance; over Valkey the restarted controller
answers at once with the same entries (test_index_valkey.py checks that instead).
"""

from __future__ import annotations

import os

import pytest

from _missing import loopback_store
from _procs import until
# in test_controller.py's order: later tests change the cluster
from test_controller import Cluster, call, lookup
from test_controller import test_lookup_picks_the_longest_hit  # noqa: F401 - collected here, over each index
from test_controller import test_wrong_or_missing_token_is_401  # noqa: F401
from test_controller import test_bad_requests_name_the_field  # noqa: F401
from test_controller import test_malformed_bodies_and_methods  # noqa: F401
from test_controller import test_commands_take_effect_in_the_instance  # noqa: F401
from test_controller import test_evictions_through_the_instance_reach_the_index  # noqa: F401
from test_controller import test_killed_instance_drops_out_of_lookups  # noqa: F401
from test_controller_caps import test_a_tenant_instance_cannot_grow_the_index_past_the_caps  # noqa: F401

#: loopback launchers (lmcache.testing.stores) of the index's servers
INDEXES = ["valkey", "redis-sentinel", "valkey-cluster"]


@pytest.fixture(scope="module", params=INDEXES, autouse=True)
def index_url(request):
    """A fresh loopback store per index kind, named by LMCACHE_CONTROLLER_INDEX for the
    controller processes the tests start (autouse: set before the module's cluster)."""
    with loopback_store(request.param) as store:
        old = os.environ.get("LMCACHE_CONTROLLER_INDEX")
        os.environ["LMCACHE_CONTROLLER_INDEX"] = store.options["url"]
        try:
            yield store.options["url"]
        finally:
            if old is None:
                os.environ.pop("LMCACHE_CONTROLLER_INDEX", None)
            else:
                os.environ["LMCACHE_CONTROLLER_INDEX"] = old


@pytest.fixture(scope="module")
def cluster(index_url, tmp_path_factory):
    """test_controller.py's cluster, started again for each index (it depends on ``index_url``)."""
    c = Cluster(tmp_path_factory.mktemp("ctl"))
    try:
        until(lambda: len(lookup(c.url)["results"]) == 3, "all three instances indexed")
        assert call(c.url, "GET", "/v1/health")[1]["index"] == "valkey"  # the controller took the URL
        yield c
    finally:
        c.close()
