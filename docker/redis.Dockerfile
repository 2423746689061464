# Redis from Debian's package, for `docker compose` where the Hub's redis image cannot be pulled
# (scripts/compose.sh). Its data in /data, as in the Hub image.
ARG BASE
FROM ${BASE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data
USER redis
WORKDIR /data
CMD ["redis-server"]
