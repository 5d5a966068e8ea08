#!/usr/bin/env bash
# Makes the kvxfer-etcd-tls material with openssl: a CA, the etcd server and peer
# certificates (for the in-cluster StatefulSet's names) and a client certificate for kvxfer.
#
#   k8s/components/etcd/in-cluster/make-certs.sh OUTDIR [NAMESPACE] [EXTRA_SAN ...]
#   kubectl -n kvxfer create secret generic kvxfer-etcd-tls \
#       --from-file=OUTDIR/ca.crt --from-file=OUTDIR/server.crt --from-file=OUTDIR/server.key \
#       --from-file=OUTDIR/peer.crt --from-file=OUTDIR/peer.key \
#       --from-file=OUTDIR/client.crt --from-file=OUTDIR/client.key
#
# EXTRA_SAN: more DNS:name or IP:address entries for the server and peer certificates.
# OUTDIR/ca.key signs the rest: keep it out of the cluster (it is not in the Secret) and
# offline, or let cert-manager hold it instead (k8s/README.md). Certificates last DAYS
# (default 365) days; the CA 10 years. Reusing an OUTDIR that has ca.crt/ca.key re-issues
# the leaf certificates under the same CA (rotation without a CA change).
set -euo pipefail
out=${1:?usage: make-certs.sh OUTDIR [NAMESPACE] [EXTRA_SAN ...]}
ns=${2:-kvxfer}
shift $(( $# >= 2 ? 2 : 1 ))
days=${DAYS:-365}
mkdir -p "$out"
cd "$out"
umask 077

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

if [[ ! -f ca.key || ! -f ca.crt ]]; then
    key ca.key
    openssl req -x509 -new -key ca.key -sha256 -days 3650 -subj "/CN=kvxfer-etcd-ca" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" -out ca.crt
fi

names=(localhost kvxfer-etcd-client "kvxfer-etcd-client.$ns" "kvxfer-etcd-client.$ns.svc"
       "kvxfer-etcd-client.$ns.svc.cluster.local")
for i in 0 1 2; do
    names+=("kvxfer-etcd-$i.kvxfer-etcd" "kvxfer-etcd-$i.kvxfer-etcd.$ns"
            "kvxfer-etcd-$i.kvxfer-etcd.$ns.svc" "kvxfer-etcd-$i.kvxfer-etcd.$ns.svc.cluster.local")
done
san="IP:127.0.0.1"
for n in "${names[@]}"; do san+=",DNS:$n"; done
for extra in "$@"; do san+=",$extra"; done

# sign NAME CN EXTENDED_KEY_USAGE [SAN]
sign() {
    local ext
    ext=$(mktemp)
    {
        echo "basicConstraints=critical,CA:FALSE"
        echo "keyUsage=critical,digitalSignature,keyEncipherment"
        echo "extendedKeyUsage=$3"
        [[ -n ${4:-} ]] && echo "subjectAltName=$4"
    } > "$ext"
    key "$1.key"
    openssl req -new -key "$1.key" -subj "/CN=$2" -out "$1.csr"
    openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 \
        -days "$days" -extfile "$ext" -out "$1.crt" 2>/dev/null
    rm -f "$1.csr" "$ext"
}
# The server certificate also authenticates etcd to itself as a client (its gRPC gateway
# dials its own client port under --client-cert-auth), hence clientAuth too.
sign server kvxfer-etcd serverAuth,clientAuth "$san"
# Peers are both ends of each connection.
sign peer kvxfer-etcd-peer serverAuth,clientAuth "$san"
# kvxfer router and workers, and the defrag job.
sign client kvxfer clientAuth
chmod 0644 ./*.crt
echo "wrote $(pwd)/{ca,server,peer,client}.{crt,key}" >&2
