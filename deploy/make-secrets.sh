#!/bin/sh
# Writes the keys deploy/docker-compose.yaml reads, one env file each, readable by the owner only:
#   sh deploy/make-secrets.sh [DIR]      (DIR defaults to deploy/secrets, which git ignores)
# A file that exists is kept, so running it again never changes a key in use; delete a file to
# get a new key. Each key is 32 random bytes from /dev/urandom in hex.
set -eu
dir="${1:-$(dirname "$0")/secrets}"
umask 077
mkdir -p "$dir"

key() {
    head -c 32 /dev/urandom | od -An -v -tx1 | tr -d ' \n'
}

write() { # FILE VARIABLE
    if [ -e "$dir/$1" ]; then
        echo "kept $dir/$1"
    else
        printf '%s=%s\n' "$2" "$(key)" >"$dir/$1"
        echo "wrote $dir/$1"
    fi
}

write orchestrator.env GUARDSTREAM_API_KEYS
write engine.env GUARDSTREAM_ENGINE_KEY
write detectors.env GUARDSTREAM_DETECTORS_KEY
write grafana.env GF_SECURITY_ADMIN_PASSWORD
echo "clients send: Authorization: Bearer \$(sed -n 's/^GUARDSTREAM_API_KEYS=//p' $dir/orchestrator.env)"
