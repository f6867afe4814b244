#!/usr/bin/env bash
# Development TLS material for the routes between the hub's nodes (hub-N:6222).
#
#   deploy/nats/dev/gen-route-certs.sh [--force] [OUT_DIR]    (OUT_DIR: deploy/certs/out)
#
# Writes into OUT_DIR, beside deploy/certs/gen-dev-certs.sh's material:
#   route-ca.pem           the routes' own CA certificate   -> every node's cluster `tls { ca_file }`
#   route-hub-N.pem        node N's certificate (N = 1..$ROUTE_NODES, default 3), signed by
#                          that CA, good for both ends of a route (serverAuth + clientAuth),
#                          SAN DNS:hub-N, DNS:localhost, IP:127.0.0.1 (+ $ROUTE_EXTRA_SANS)
#   route-hub-N-key.pem    node N's private key             -> node N's cluster `tls { key_file }`
#
# The routes get a CA of their own rather than the one sites trust for the WebSocket
# (gen-dev-certs.sh's, or a public one in production): a node accepts a route only from a
# certificate this CA signed, so no certificate made for anything else can pass for a node.
# The CA's private key is never written: it signs the nodes' certificates and is gone, so a
# new node means new certificates for all (--force). Existing material is kept unless
# --force is given. Private keys are never committed (deploy/certs/.gitignore ignores out/).
# For development only: in production issue the nodes' certificates from your own CA, with
# their real names (ROUTE_EXTRA_SANS="DNS:nats-1.example.com" applies to every node).
set -euo pipefail

force=0
if [ "${1:-}" = "--force" ]; then
  force=1
  shift
fi
if [ $# -gt 1 ]; then
  echo "usage: $0 [--force] [OUT_DIR]" >&2
  exit 2
fi
out=${1:-"$(cd "$(dirname "$0")/../../certs" && pwd)/out"}
days=${CERT_DAYS:-825}
nodes=${ROUTE_NODES:-3}

command -v openssl >/dev/null 2>&1 || { echo "openssl is required" >&2; exit 1; }
mkdir -p "$out"
if [ "$force" = 0 ] && [ -s "$out/route-ca.pem" ] && [ -s "$out/route-hub-$nodes-key.pem" ]; then
  echo "route certificates already in $out (use --force to make new ones)" >&2
  exit 0
fi

umask 077
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The CA: a self-signed EC P-256 certificate that may sign (and only sign) certificates.
openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
  -keyout "$tmp/ca-key.pem" -out "$tmp/route-ca.pem" -days "$days" -sha256 \
  -subj "/O=Baton development/CN=Baton dev hub routes CA" \
  -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" 2>"$tmp/log" \
  || { cat "$tmp/log" >&2; exit 1; }

made=()
for n in $(seq 1 "$nodes"); do
  name="hub-$n"
  sans="DNS:$name,DNS:localhost,IP:127.0.0.1${ROUTE_EXTRA_SANS:+,$ROUTE_EXTRA_SANS}"
  openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
    -keyout "$tmp/route-$name-key.pem" -out "$tmp/$name.csr" \
    -subj "/O=Baton development/CN=$name" 2>"$tmp/log" \
    || { cat "$tmp/log" >&2; exit 1; }
  # A route is dialled by one node and accepted by another, each checking the other's
  # certificate (`verify: true`): Go's TLS wants serverAuth of the one, clientAuth of the
  # other, and checks names only against the SAN.
  cat >"$tmp/$name.ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=$sans
EXT
  openssl x509 -req -in "$tmp/$name.csr" -CA "$tmp/route-ca.pem" -CAkey "$tmp/ca-key.pem" \
    -set_serial "0x$(openssl rand -hex 16)" -days "$days" -sha256 \
    -extfile "$tmp/$name.ext" -out "$tmp/route-$name.pem" 2>"$tmp/log" \
    || { cat "$tmp/log" >&2; exit 1; }
  openssl verify -CAfile "$tmp/route-ca.pem" "$tmp/route-$name.pem" >/dev/null
  chmod 644 "$tmp/route-$name.pem"
  chmod 600 "$tmp/route-$name-key.pem"
  made+=("$tmp/route-$name.pem" "$tmp/route-$name-key.pem")
done

# Certificates are public; keys readable by their owner only (the nats image runs as root).
chmod 644 "$tmp/route-ca.pem"
mv -f "$tmp/route-ca.pem" "${made[@]}" "$out/"
echo "wrote $out/route-ca.pem and route-hub-{1..$nodes}{,-key}.pem (routes' own CA)" >&2
