# The run-a-peer image: one `docker run` serves a pipeline stage of a swarm (README, "Run a peer").
#
#   docker/wheelhouse.sh cpu   && docker build -t swarm-peer .
#   docker/wheelhouse.sh cuda  && docker build --build-arg TORCH_VARIANT=cuda -t swarm-peer:cuda .
#
# Every Python package is installed from wheelhouse/<variant>/ in the build context, so the build
# reaches no Python index; only python3 and tini come from Debian's mirror. The CUDA variant needs
# no CUDA base image: PyPI's torch wheels carry the CUDA runtime, the host gives the driver
# (`docker run --gpus all`).
#
# Configuration: `-e SWARM_INITIAL_PEERS=...` is all a volunteer gives: the run's spec says what to
# train and the peer picks its stage. Every `swarm peer` flag is also an environment variable
# (--stage is SWARM_STAGE, ...); flags after the image name still work.

ARG BASE_IMAGE=debian:bookworm-slim

# --- Python 3.11 (bookworm's) and tini, shared by both stages --------------------------------------
FROM ${BASE_IMAGE} AS base
# Debian's package versions move with bookworm's point releases; pinning them would break the build.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv tini \
 && rm -rf /var/lib/apt/lists/*

# --- the dependencies, from the wheelhouse into /opt/venv ------------------------------------------
FROM base AS dependencies
ARG TORCH_VARIANT=cpu
RUN python3 -m venv /opt/venv
# torch first and alone: this layer changes only with torch's pin or variant, never with the code.
COPY wheelhouse/${TORCH_VARIANT}/torch/ /wheels/torch/
RUN /opt/venv/bin/pip install --no-cache-dir --no-index --find-links /wheels/torch torch
COPY wheelhouse/${TORCH_VARIANT}/deps/ /wheels/deps/
RUN /opt/venv/bin/pip install --no-cache-dir --no-index --find-links /wheels/torch --find-links /wheels/deps \
        -r /wheels/deps/requirements.txt

# --- the image -------------------------------------------------------------------------------------
FROM base
ARG TORCH_VARIANT=cpu
LABEL org.opencontainers.image.title="swarm peer" \
      org.opencontainers.image.description="Serves one pipeline stage of a swarm-trained model" \
      io.swarm.torch-variant="${TORCH_VARIANT}"

RUN useradd --create-home --uid 1000 --user-group --shell /usr/sbin/nologin swarm \
 && mkdir -p /data \
 && chown swarm:swarm /data
COPY --from=dependencies /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

# The code last: a change to it rebuilds only these layers.
WORKDIR /opt/swarm-src
COPY pyproject.toml README.md ./
COPY process/ process/
COPY wire/ wire/
COPY models/ models/
COPY dht/ dht/
COPY peers/ peers/
COPY swarm/ swarm/
RUN pip install --no-cache-dir --no-deps --no-index --no-build-isolation . \
 && rm -rf build ./*.egg-info

# Defaults for a container; SWARM_INITIAL_PEERS is the volunteer's to give.
# Listen on every interface of the container, so that `-p` port maps reach the peer. The metrics
# settings take effect where the peer has --metrics-port/--metrics-host (the metrics issue).
ENV SWARM_HOST_MADDRS=/ip4/0.0.0.0/tcp/31337 \
    SWARM_IDENTITY_PATH=/data/identity.key \
    SWARM_CHECKPOINT_DIR=/data/checkpoints \
    SWARM_STATUS_FILE=/tmp/swarm-peer-status.json \
    SWARM_METRICS_PORT=9100 \
    SWARM_METRICS_HOST=0.0.0.0 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# The peer identity (a stable peer id across restarts) and the stage's checkpoints.
VOLUME ["/data"]
# 31337: libp2p (the DHT and the peer's RPCs); 9100: Prometheus metrics.
EXPOSE 31337/tcp 9100/tcp

USER 1000:1000
WORKDIR /data
# The peer writes its status file at every announcement; this asks whether it is online and fresh.
HEALTHCHECK --interval=30s --timeout=10s --start-period=180s --retries=3 CMD ["python", "-m", "peers.health"]
# tini reaps the DHT's child processes and passes SIGTERM on, so the peer announces offline and
# saves its checkpoint before it exits (give it time: `docker stop -t 30`).
ENTRYPOINT ["tini", "--", "swarm", "peer"]
CMD []
