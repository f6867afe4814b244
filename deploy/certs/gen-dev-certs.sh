#!/usr/bin/env bash
# Development TLS material for the hub's WebSocket listener (wss://hub:443).
#
#   deploy/certs/gen-dev-certs.sh [--force] [OUT_DIR]      (OUT_DIR: deploy/certs/out)
#
# Writes into OUT_DIR:
#   ca.pem        the development CA certificate  -> every leaf's `tls { ca_file }`
#   ca-key.pem    the CA's private key            (stays here; needed only to sign again)
#   hub.pem       the hub's server certificate, signed by the CA, with
#                 SAN DNS:hub, DNS:hub-1..3, DNS:localhost, IP:127.0.0.1 (+ $HUB_EXTRA_SANS)
#   hub-key.pem   the hub's private key           -> the hub's `tls { key_file }`
#
# Existing material is kept (a new CA would lock out every leaf that trusts the old one)
# unless --force is given. Private keys are never committed: deploy/certs/.gitignore
# ignores out/. These certificates are for development only: use your own CA (or a
# public one) in production, and add the hub's real name, e.g.
#   HUB_EXTRA_SANS="DNS:nats.example.com" deploy/certs/gen-dev-certs.sh --force
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
out=${1:-"$(cd "$(dirname "$0")" && pwd)/out"}
days=${CERT_DAYS:-825}
sans="DNS:hub,DNS:hub-1,DNS:hub-2,DNS:hub-3,DNS:localhost,IP:127.0.0.1${HUB_EXTRA_SANS:+,$HUB_EXTRA_SANS}"

command -v openssl >/dev/null 2>&1 || { echo "openssl is required" >&2; exit 1; }
mkdir -p "$out"
if [ "$force" = 0 ] && [ -s "$out/ca.pem" ] && [ -s "$out/hub.pem" ] && [ -s "$out/hub-key.pem" ]; then
  echo "dev certificates already in $out (use --force to make new ones)" >&2
  exit 0
fi

umask 077
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The CA: a self-signed EC P-256 certificate that may sign (and only sign) certificates.
openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
  -keyout "$tmp/ca-key.pem" -out "$tmp/ca.pem" -days "$days" -sha256 \
  -subj "/O=Baton development/CN=Baton dev CA" \
  -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" 2>"$tmp/log" \
  || { cat "$tmp/log" >&2; exit 1; }

# The hub's server certificate. Go's TLS (nats-server, the leaf's client side) checks
# names only against the SAN, never the CN.
openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
  -keyout "$tmp/hub-key.pem" -out "$tmp/hub.csr" \
  -subj "/O=Baton development/CN=hub" 2>"$tmp/log" \
  || { cat "$tmp/log" >&2; exit 1; }
cat >"$tmp/hub.ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth
subjectAltName=$sans
EXT
openssl x509 -req -in "$tmp/hub.csr" -CA "$tmp/ca.pem" -CAkey "$tmp/ca-key.pem" \
  -set_serial "0x$(openssl rand -hex 16)" -days "$days" -sha256 \
  -extfile "$tmp/hub.ext" -out "$tmp/hub.pem" 2>"$tmp/log" \
  || { cat "$tmp/log" >&2; exit 1; }
openssl verify -CAfile "$tmp/ca.pem" "$tmp/hub.pem" >/dev/null

# Certificates are public; keys readable by their owner only. The official nats image
# runs as root, so a 0600 key mounted read-only is readable by the hub.
chmod 644 "$tmp/ca.pem" "$tmp/hub.pem"
chmod 600 "$tmp/ca-key.pem" "$tmp/hub-key.pem"
mv -f "$tmp/ca.pem" "$tmp/ca-key.pem" "$tmp/hub.pem" "$tmp/hub-key.pem" "$out/"
echo "wrote $out/{ca.pem,ca-key.pem,hub.pem,hub-key.pem} (hub SAN: $sans)" >&2
