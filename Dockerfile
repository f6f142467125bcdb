# kvlb: the balancer (`kvlb serve`), and the engine emulator (`kvlb emulate`) for trials.
#   docker build -t kvlb:dev .
#   docker run --rm -p 8000:8000 -v $PWD/kvlb.yaml:/etc/kvlb/config.yaml:ro kvlb:dev
# Settings: /etc/kvlb/config.yaml ($KVLB_CONFIG), then KVLB_* variables (docs/operations.md).

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY balancer/ balancer/
COPY replicas/ replicas/
COPY loadtests/ loadtests/
COPY proto/ proto/
COPY deploy/docker/install.sh /usr/local/bin/kvlb-install
RUN kvlb-install /opt/kvlb /src

FROM python:3.11-slim-bookworm
LABEL org.opencontainers.image.title="kvlb" \
      org.opencontainers.image.description="KV-cache-aware load balancer for LLM inference" \
      org.opencontainers.image.licenses="Apache-2.0"
# libjemalloc2: `allocator: auto` (the default) runs kvlb serve on jemalloc when it is installed
# (docs/operations.md, "The allocator"); without it kvlb runs on the C library's malloc and says so.
# tini: the container's PID 1 (the ENTRYPOINT below; docs/operations.md, "Health, readiness and
# draining").
RUN apt-get update \
    && apt-get install --yes --no-install-recommends libjemalloc2=5.3.0-1 tini=0.19.0-1+b3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 kvlb \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvlb
COPY --from=build /opt/kvlb /opt/kvlb
ENV PATH=/opt/kvlb/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVLB_CONFIG=/etc/kvlb/config.yaml \
    KVLB_LISTEN__HOST=0.0.0.0
USER 10001:10001
EXPOSE 8000 50051
# tini is PID 1 and kvlb serve its child. The kernel gives PID 1 of a PID namespace no signal it has
# no handler for: kvlb itself as PID 1 lost a SIGTERM sent in its first 30-80 ms (the interpreter's
# start, before its handler) and served on until the SIGKILL at the end of the grace, and it reaps only
# its own workers, so a process orphaned in the container (a `docker exec`'s) stayed a zombie. tini
# takes every signal from its start, forwards it to kvlb, and reaps every orphan. Not `tini -g`: with
# --workers N the supervisor forwards SIGTERM to its workers itself (and closes its listening socket
# as it does); -g would signal each worker a second time. kvlb serve handles SIGTERM itself: it stops
# accepting, drains for --shutdown-grace-s, then exits 0 (tini exits with kvlb's status).
ENTRYPOINT ["tini", "--", "kvlb", "serve"]
