# guardstream: one image for the orchestrator, the engine and the detector service.
#   make image                                                  # CPU torch: guardstream:cpu
#   docker build -t guardstream:cpu .                           # the same, by hand
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#                --build-arg TORCH_VARIANT=cu128 -t guardstream:cuda .
# (torch's CUDA wheels carry the CUDA runtime, so TORCH_VARIANT=cu128 on the default base also
# runs on a GPU; the NVIDIA container runtime mounts the driver either way.)
# The command picks the role: python -m orchestrator serve | python -m generation serve | python -m detectors serve
# The build needs PyPI and a torch index for TORCH_VARIANT (download.pytorch.org by default;
# --build-arg TORCH_INDEX_URL=... names a mirror or a local index where only the package
# registries are reachable); nothing is downloaded at run time.
# Stopping: the orchestrator drains for server.drain_timeout_s (default 30 s) plus 7 s to end
# what is left with a terminal event; give it longer than that (`docker stop -t 45`,
# `docker run --stop-timeout 45`, compose's stop_grace_period), or a stop cuts streams mid-way.
# Any UID in group 0 (OpenShift's arbitrary UIDs) can read the model cache and use the home.
ARG BASE_IMAGE=python:3.11-slim
ARG BUILD_IMAGE=python:3.11-slim

FROM ${BUILD_IMAGE} AS build
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY requirements.txt requirements-nodeps.txt ./
# Same pinned requirements as `make`; torch==2.13.0 is in the same command as transformers.
# The extra index serves the torch build for TORCH_VARIANT (cpu, or e.g. cu128).
RUN /opt/venv/bin/pip install --extra-index-url "${TORCH_INDEX_URL}" -r requirements.txt \
 && /opt/venv/bin/pip install --no-deps -r requirements-nodeps.txt
# When download.pytorch.org cannot be reached pip only warns, and installs PyPI's torch of the
# same version: a CUDA build with several GB of nvidia-* and cuda-* packages. Fail loudly instead.
RUN set -eu; \
    installed=$(/opt/venv/bin/python -c 'import torch; print(torch.__version__)'); \
    case "$installed" in \
      *"+${TORCH_VARIANT}") ;; \
      *) echo "ERROR: torch $installed is installed, TORCH_VARIANT=${TORCH_VARIANT} wants +${TORCH_VARIANT} (was ${TORCH_INDEX_URL} reachable?)" >&2; exit 1 ;; \
    esac; \
    if [ "${TORCH_VARIANT}" = cpu ]; then \
      cuda=$(/opt/venv/bin/pip list --format=freeze | grep -iE '^(nvidia-|cuda-|triton=)' || true); \
      if [ -n "$cuda" ]; then echo "ERROR: CUDA packages in a CPU image:" >&2; echo "$cuda" >&2; exit 1; fi; \
    fi; \
    echo "torch $installed ($TORCH_VARIANT)"
# Never imported at run time: torch's C++ test binaries (84 MB). Its headers (62 MB) serve C++
# extensions and torch.compile's C++ code: a CUDA image keeps them for the engine's `--compile`
# (Inductor), a CPU image (no compiler in it, eager steps) leaves them out.
RUN rm -rf /opt/venv/lib/python3.11/site-packages/torch/test; \
    if [ "$TORCH_VARIANT" = "cpu" ]; then rm -rf /opt/venv/lib/python3.11/site-packages/torch/include; fi
COPY pyproject.toml README.md ./
COPY orchestrator ./orchestrator
COPY chunkers ./chunkers
COPY detectors ./detectors
COPY generation ./generation
COPY servicekit ./servicekit
RUN /opt/venv/bin/pip install --no-deps --no-build-isolation .
# Convert the default model once, at build time, so replicas start in about a second.
ENV GUARDSTREAM_CACHE=/opt/guardstream-cache HF_HUB_OFFLINE=1
RUN /opt/venv/bin/python -m generation prepare smollm2-135m
# The converted files are created 0600: group 0 gets the owner's rights (OpenShift convention),
# so a container run as any UID in group 0 (`--user 12345:0`) loads the model.
RUN chgrp -R 0 /opt/guardstream-cache && chmod -R g=u /opt/guardstream-cache

# /opt/venv/bin/python is the build stage's /usr/local/bin/python3.11. A runtime base that has
# that interpreter already (python:3.11-slim, the default) needs nothing; any other glibc base
# (CUDA images: Ubuntu 24.04 has no python3.11 package) needs it brought along. This stage
# collects only the files of the build stage's /usr/local that the base lacks or has otherwise,
# so the default image carries no second copy of /usr/local (51 MB).
FROM ${BASE_IMAGE} AS python-for-base
COPY --from=build /usr/local /opt/build-usrlocal
RUN set -eu; src=/opt/build-usrlocal; base=/usr/local; out=/opt/python-extra; \
    mkdir -p "$out"; cd "$src"; \
    find . ! -type d | while IFS= read -r f; do \
      if [ -L "$f" ]; then \
        if [ -L "$base/$f" ] && [ "$(readlink "$f")" = "$(readlink "$base/$f")" ]; then continue; fi; \
      elif [ -f "$base/$f" ] && [ ! -L "$base/$f" ] && cmp -s "$f" "$base/$f"; then continue; fi; \
      cp -a --parents "$f" "$out/"; \
    done; \
    echo "python files the base lacks: $(find "$out" ! -type d | wc -l)"

FROM ${BASE_IMAGE} AS runtime
COPY --from=python-for-base /opt/python-extra /usr/local
# On a base without python's shared libraries, add the ones it links against. The user is in
# group 0 and its home belongs to group 0 as well, for arbitrary UIDs.
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
    useradd --create-home --uid 10001 --gid 0 guardstream; \
    chmod g=u /home/guardstream
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=10001:0 /opt/guardstream-cache /opt/guardstream-cache
COPY config.yaml /etc/guardstream/config.yaml
ENV PATH=/opt/venv/bin:$PATH GUARDSTREAM_CACHE=/opt/guardstream-cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
USER 10001
WORKDIR /home/guardstream
EXPOSE 8033 8090 8080
STOPSIGNAL SIGTERM
CMD ["python", "-m", "orchestrator", "serve", "--config", "/etc/guardstream/config.yaml", "--port", "8033"]
