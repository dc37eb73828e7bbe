# guardstream: one image for the orchestrator, the engine and the detector service.
#   docker build -t guardstream .                               # CPU torch (default)
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#                --build-arg TORCH_VARIANT=cu128 -t guardstream:cuda .
# (torch's CUDA wheels carry the CUDA runtime, so TORCH_VARIANT=cu128 on the default base also
# runs on a GPU; the NVIDIA container runtime mounts the driver either way.)
# The command picks the role: python -m orchestrator serve | python -m generation serve | python -m detectors serve
# The build needs PyPI and download.pytorch.org; nothing is downloaded at run time.
ARG BASE_IMAGE=python:3.11-slim
ARG BUILD_IMAGE=python:3.11-slim

FROM ${BUILD_IMAGE} AS build
ARG TORCH_VARIANT=cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY requirements.txt requirements-nodeps.txt ./
# Same pinned requirements as `make`; torch==2.13.0 is in the same command as transformers.
# The extra index serves the torch build for TORCH_VARIANT (cpu, or e.g. cu128).
RUN /opt/venv/bin/pip install --extra-index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" -r requirements.txt \
 && /opt/venv/bin/pip install --no-deps -r requirements-nodeps.txt
COPY pyproject.toml README.md ./
COPY orchestrator ./orchestrator
COPY chunkers ./chunkers
COPY detectors ./detectors
COPY generation ./generation
RUN /opt/venv/bin/pip install --no-deps --no-build-isolation .
# Convert the default model once, at build time, so replicas start in about a second.
ENV GUARDSTREAM_CACHE=/opt/guardstream-cache HF_HUB_OFFLINE=1
RUN /opt/venv/bin/python -m generation prepare smollm2-135m

FROM ${BASE_IMAGE} AS runtime
# /opt/venv/bin/python is the build stage's /usr/local/bin/python3.11: bring that interpreter along
# (identical files on python:3.11-slim), so any glibc base works, CUDA images included (Ubuntu
# 24.04 has no python3.11 package). On such a base, add the shared libraries it links against.
COPY --from=build /usr/local /usr/local
RUN set -eux; ldconfig; \
    check='import ssl, ctypes, sqlite3, bz2, lzma, zlib, uuid, pyexpat'; \
    if ! /usr/local/bin/python3.11 -c "$check" 2>/dev/null; then \
      apt-get update; \
      ssl=libssl3; if apt-cache show libssl3t64 >/dev/null 2>&1; then ssl=libssl3t64; fi; \
      apt-get install -y --no-install-recommends ca-certificates "$ssl" libffi8 libsqlite3-0 \
        libbz2-1.0 liblzma5 zlib1g libexpat1 libuuid1; \
      rm -rf /var/lib/apt/lists/*; \
      /usr/local/bin/python3.11 -c "$check"; \
    fi; \
    useradd --create-home --uid 10001 guardstream
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=guardstream:guardstream /opt/guardstream-cache /opt/guardstream-cache
COPY config.yaml /etc/guardstream/config.yaml
ENV PATH=/opt/venv/bin:$PATH GUARDSTREAM_CACHE=/opt/guardstream-cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
USER guardstream
WORKDIR /home/guardstream
EXPOSE 8033 8090 8080
CMD ["python", "-m", "orchestrator", "serve", "--config", "/etc/guardstream/config.yaml", "--port", "8033"]
