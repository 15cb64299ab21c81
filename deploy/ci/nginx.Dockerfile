# Debian's nginx, standing in for the official nginx image where no registry can be reached
# (deploy/ci/docker.sh builds it as mha-serve-ci/nginx; deploy/ci/docker-compose.ci.yml uses it).
# Like the official image, it renders /etc/nginx/templates/*.template into /etc/nginx/conf.d/ at
# start-up with envsubst, over the variables NGINX_ENVSUBST_FILTER matches (nginx-entrypoint.sh).
ARG BASE=mha-serve-ci/python:3.11-bookworm
# DL3006 (tag the image): the base is a local image deploy/ci/docker.sh makes and names.
# hadolint ignore=DL3006
FROM ${BASE}
# DL3008 (pin apt versions): the pin is the base image's Debian release (bookworm).
# policy-rc.d: no init system in a build, so the package must not try to start nginx.
# hadolint ignore=DL3008
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
    && apt-get update \
    && apt-get install -y --no-install-recommends nginx gettext-base wget \
    && rm -rf /var/lib/apt/lists/* /etc/nginx/sites-enabled/* \
    && mkdir -p /etc/nginx/templates /etc/nginx/conf.d
COPY nginx-entrypoint.sh /usr/local/bin/nginx-entrypoint.sh
EXPOSE 8080
STOPSIGNAL SIGQUIT
ENTRYPOINT ["/bin/sh", "/usr/local/bin/nginx-entrypoint.sh"]
