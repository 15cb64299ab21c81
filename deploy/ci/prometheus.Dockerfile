# Debian's prometheus, standing in for prom/prometheus where no registry can be reached
# (deploy/ci/docker.sh builds it as mha-serve-ci/prometheus; deploy/ci/docker-compose.ci.yml uses
# it). Same contract as that image: the binary is the entrypoint, the config comes from
# /etc/prometheus, the TSDB lives in /prometheus, and it runs as an unprivileged user.
ARG BASE=mha-serve-ci/python:3.11-bookworm
# DL3006 (tag the image): the base is a local image deploy/ci/docker.sh makes and names.
# hadolint ignore=DL3006
FROM ${BASE}
# DL3008 (pin apt versions): the pin is the base image's Debian release (bookworm).
# policy-rc.d: no init system in a build, so the package must not try to start prometheus.
# hadolint ignore=DL3008
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
    && apt-get update \
    && apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir /prometheus && chown 65534:65534 /prometheus
# nobody, as in prom/prometheus: numeric, so runAsNonRoot-style checks need no passwd lookup.
USER 65534:65534
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
