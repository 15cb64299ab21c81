#!/bin/sh
# The official nginx image's template step, for Debian's nginx: each
# /etc/nginx/templates/X.template becomes /etc/nginx/conf.d/X, with only the environment
# variables matching NGINX_ENVSUBST_FILTER substituted (nginx's own $variables stay), then nginx
# runs in the foreground as PID 1.
set -eu
names=$(awk 'BEGIN { for (v in ENVIRON) print v }' | grep -E "${NGINX_ENVSUBST_FILTER:-.}" || true)
defined=$(printf '$%s ' $names)
for template in /etc/nginx/templates/*.template; do
  [ -e "$template" ] || continue
  envsubst "$defined" <"$template" >"/etc/nginx/conf.d/$(basename "$template" .template)"
done
exec nginx -g 'daemon off;'
