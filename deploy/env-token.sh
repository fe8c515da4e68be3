#!/usr/bin/env bash
# Gives the compose stack its shared token: writes deploy/.env (from .env.example when there is none)
# with RLMESH_AUTH_TOKEN set to a fresh random token, unless it already holds one. Every rlmesh
# container reads it: the services refuse calls without it, the coordinator sends it.
#   bash deploy/env-token.sh            # deploy/.env (docker compose reads it beside the compose file)
#   bash deploy/env-token.sh FILE       # another file (docker compose --env-file FILE)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
env_file=${1:-$here/.env}
[ -f "$env_file" ] || (umask 077 && cp "$here/.env.example" "$env_file")
chmod 600 "$env_file"  # the token is a credential: this user only
if grep -qE '^RLMESH_AUTH_TOKEN=.+' "$env_file"; then
  echo "$env_file already holds RLMESH_AUTH_TOKEN; kept"
  exit 0
fi
token=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
if grep -q '^RLMESH_AUTH_TOKEN=' "$env_file"; then
  sed -i "s/^RLMESH_AUTH_TOKEN=.*/RLMESH_AUTH_TOKEN=$token/" "$env_file"
else
  echo "RLMESH_AUTH_TOKEN=$token" >>"$env_file"
fi
echo "wrote a new RLMESH_AUTH_TOKEN into $env_file"
