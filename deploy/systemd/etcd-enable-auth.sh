#!/bin/sh
# Turns on etcd's auth for ftd, idempotently (a re-run changes nothing). The same script runs as the
# Kubernetes Job in deploy/kubernetes/etcd-auth.yaml (its ConfigMap holds a copy; a test keeps them equal).
#
#   ETCDCTL_ENDPOINTS=https://etcd-1:2379,https://etcd-2:2379,https://etcd-3:2379 \
#   ETCDCTL_CACERT=/etc/ftd/pki/ca.crt ETCDCTL_CERT=/etc/ftd/pki/etcd/m0.crt ETCDCTL_KEY=/etc/ftd/pki/etcd/m0.key \
#     sh etcd-enable-auth.sh
#
# etcd runs with --client-cert-auth, so a client certificate's CN is its etcd user name (ftd's certificates
# have CN ftd-<kind>). Every user is created without a password: it can only log in with a certificate.
#   root             required by `auth enable`; no certificate has CN root, so nobody logs in as it
#   ftd-etcd         role root: the etcd members' own certificates administer etcd (this script, etcdctl
#                    defrag / alarm disarm); a member holds the whole database anyway
#   ftd-coordinator  role root: its keys under /ftd/, and the leader keeps etcd's space (it deletes a
#                    rendezvous run over its budget, compacts, defragments, disarms NOSPACE): etcd 3.4 lets
#                    only root defragment
#   ftd-rendezvous   role ftd-rendezvous: read-write on /torch/elastic/rendezvous/ (the etcd-v3 rendezvous
#                    state) and /torch/elastic/store/ (its c10d store), nothing of ftd's
# Node, operator and any other certificates of the CA map to no user; etcd refuses them in the TLS
# handshake already (--client-cert-allowed-hostname=etcd-client.ftd.internal, a name only coordinator and
# etcd certificates carry, and rendezvous certificates issued with --etcd-client for torchrun's etcd-v3
# rendezvous): etcd checks no permission on leases or alarms (docs/security.md).
#
# Needs etcdctl (3.4+: user add --no-password) as $ETCDCTL_BIN or on PATH, and a certificate with CN
# ftd-etcd (or a root user's credentials) once auth is on. Waits up to WAIT_S seconds (default 600) for
# every endpoint to be healthy first.
set -eu

e() { "${ETCDCTL_BIN:-etcdctl}" "$@"; }

waited=0
until e endpoint health >/dev/null 2>&1; do
  if [ "$waited" -ge "${WAIT_S:-600}" ]; then
    echo "etcd-enable-auth: etcd not healthy after ${waited}s: $(e endpoint health 2>&1 | tail -n 3)" >&2
    exit 1
  fi
  sleep 5
  waited=$((waited + 5))
done

user() {  # user NAME ROLE: NAME exists (certificate login only) and has ROLE
  e user get "$1" >/dev/null 2>&1 || e user add "$1" --no-password
  roles=$(e user get "$1" | sed -n 's/^Roles: *//p')
  case " $roles " in
    *" $2 "*) ;;
    *) e user grant-role "$1" "$2" ;;
  esac
}
role() {  # role NAME PREFIX...: NAME exists and may read and write every key under each PREFIX
  name=$1
  shift
  e role get "$name" >/dev/null 2>&1 || e role add "$name"
  for prefix in "$@"; do
    e role grant-permission "$name" --prefix=true readwrite "$prefix"
  done
}

role ftd-rendezvous /torch/elastic/rendezvous/ /torch/elastic/store/
user root root
user ftd-etcd root
user ftd-coordinator root
user ftd-rendezvous ftd-rendezvous
e auth enable
echo "etcd-enable-auth: auth is on; users: $(e user list | tr '\n' ' ')"
