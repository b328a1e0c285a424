# Two images, one recipe. Both run `atoll syncer` (a shard) and `atoll learner`:
#
#   docker build -t REGISTRY/atoll:0.1.0 .                        # CPU: shards, CPU learners
#   docker build --target tpu -t REGISTRY/atoll-tpu:0.1.0 .       # TPU learners (adds libtpu)
#
# Layers go from what changes least to what changes most: the toolchain, then the
# dependencies pyproject.toml pins (and, for the TPU image, jax[tpu] at the same jax
# version), and only then the sources, installed with `pip install --no-deps .`. A code
# change therefore rebuilds only the last layers; jax and libtpu come from the cache.
# The final stages get the virtual environment alone, no compiler.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS toolchain
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/atoll
WORKDIR /src

# The pinned runtime dependencies, read from pyproject.toml alone: editing code leaves
# this layer cached.
FROM toolchain AS deps
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > requirements.txt \
 && /opt/atoll/bin/pip install -r requirements.txt

# The TPU runtime: jax's `tpu` extra at the jax version pyproject.toml pins, which brings
# the matching libtpu. The build fails here, not on a TPU host, if libtpu is missing.
FROM deps AS deps-tpu
RUN python -c "import tomllib; print(next(d for d in tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'] if d.startswith('jax==')).replace('jax==', 'jax[tpu]=='))" > requirements-tpu.txt \
 && /opt/atoll/bin/pip install -r requirements-tpu.txt \
      -f https://storage.googleapis.com/jax-releases/libtpu_releases.html \
 && /opt/atoll/bin/python -c "import libtpu"

# The sources: only what `pip install .` reads (the metadata, the C extension's setup.py,
# the four packages).
FROM scratch AS sources
COPY pyproject.toml setup.py README.md /src/
COPY atoll /src/atoll
COPY server /src/server
COPY learner /src/learner
COPY wire /src/wire

# The build stages install the sources, then check what they installed: the compiled
# kernels load, a codec round trip goes through them (integers in [-7, 7] are exact in
# INT4), `atoll --help` imports every command, and `pip check` finds every pin still met
# (in the TPU image, after jax[tpu]). The checks run from /: in /src, the sources' atoll/
# (without server, learner, wire or the kernels) would shadow the installed package.
# tests/integration/test_image.py runs every RUN command here without a container engine.
FROM deps AS build
COPY --from=sources /src /src
RUN /opt/atoll/bin/pip install --no-deps .
WORKDIR /
RUN /opt/atoll/bin/python -c "import atoll.wire._kernels" \
 && /opt/atoll/bin/python -c "import numpy as np; from atoll.wire import codec; x = np.arange(-7, 8, dtype=np.float32); assert (codec.decode(codec.encode(x)) == x).all()" \
 && /opt/atoll/bin/atoll --help > /dev/null \
 && /opt/atoll/bin/pip check

FROM deps-tpu AS build-tpu
COPY --from=sources /src /src
RUN /opt/atoll/bin/pip install --no-deps .
WORKDIR /
RUN /opt/atoll/bin/python -c "import atoll.wire._kernels" \
 && /opt/atoll/bin/python -c "import numpy as np; from atoll.wire import codec; x = np.arange(-7, 8, dtype=np.float32); assert (codec.decode(codec.encode(x)) == x).all()" \
 && /opt/atoll/bin/atoll --help > /dev/null \
 && /opt/atoll/bin/pip check \
 && /opt/atoll/bin/python -c "import libtpu"

FROM ${PYTHON_IMAGE} AS runtime
# A fixed UID/GID so the manifests can say runAsUser/fsGroup 10001.
RUN groupadd --system --gid 10001 atoll \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/atoll \
            --shell /usr/sbin/nologin atoll
ENV PATH=/opt/atoll/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/atoll
# gRPC (syncer), syncer /metrics, learner /metrics.
EXPOSE 50051 9090 9091
ENTRYPOINT ["atoll"]
CMD ["--help"]

# Same base image and path as the build stages, so the venv's interpreter link holds.
FROM runtime AS tpu
COPY --from=build-tpu /opt/atoll /opt/atoll
USER 10001:10001

# The default target (last): the CPU image.
FROM runtime AS cpu
COPY --from=build /opt/atoll /opt/atoll
USER 10001:10001
