# One image for both roles: `atoll syncer` (a shard) and `atoll learner` (an island).
#
#   docker build -t atoll .
#   docker build -t atoll:tpu --build-arg EXTRA_PIP="jax[tpu]==0.10.2" .   # TPU learners
#
# The build stage compiles wire/_kernels.c (setup.py) into a wheel-installed venv;
# the final stage gets only that venv, no compiler.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/atoll
WORKDIR /src
# Only what `pip install .` reads: the metadata, the C extension's setup.py, the packages.
COPY pyproject.toml setup.py README.md ./
COPY atoll ./atoll
COPY server ./server
COPY learner ./learner
COPY wire ./wire
RUN /opt/atoll/bin/pip install . \
 && /opt/atoll/bin/python -c "import wire._kernels"
# Extra wheels for an accelerator, e.g. "jax[tpu]==0.10.2" (adds libtpu); empty by default.
ARG EXTRA_PIP=""
RUN if [ -n "$EXTRA_PIP" ]; then /opt/atoll/bin/pip install $EXTRA_PIP; fi

FROM ${PYTHON_IMAGE}
# A fixed UID/GID so the manifests can say runAsUser/fsGroup 10001.
RUN groupadd --system --gid 10001 atoll \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/atoll \
            --shell /usr/sbin/nologin atoll
# Same base image and path as the build stage, so the venv's interpreter link holds.
COPY --from=build /opt/atoll /opt/atoll
ENV PATH=/opt/atoll/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/atoll
# gRPC (syncer), syncer /metrics, learner /metrics.
EXPOSE 50051 9090 9091
ENTRYPOINT ["atoll"]
CMD ["--help"]
