"""``ftctl certs init|issue|rotate|list``: the cluster's PKI from the operator's machine (:mod:`ftd.ca`).

    ftctl certs init --cluster prod --pki-dir /etc/ftd/pki
    ftctl certs issue node node-7 --host node-7.example --host 10.0.0.7
    ftctl certs issue rendezvous node-7 --etcd-client   # only for torchrun --rdzv-backend=etcd-v3
    ftctl certs rotate rendezvous node-7 --no-etcd-client   # takes etcd away from it again
    ftctl certs rotate coordinator c0          # served to new connections without a restart
    ftctl certs list
    ftctl certs revoke node/node-1 --reason "host compromised"   # refused everywhere within seconds
    ftctl certs rotate node node-1             # also revokes the old certificate's serial


The PKI directory is ``--pki-dir``, else ``$FTD_PKI_DIR``, else ``DIR/pki`` of ``--workdir DIR``.
Hooked into ``ftctl`` by :func:`register` (the parser) and :func:`run` (the command); :func:`main` runs
it alone. Exit codes as ftctl's: 0 ok, 1 the PKI refused (the message names the file), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import grpc

from ftd.ca import CA_DAYS, LEAF_DAYS, certificate_info, init_ca, issue, rotate
from ftd.client import CoordinatorClient
from ftd.identity import KINDS, PkiError, paths
from ftd.rpc import rpc_code, rpc_details
from ftd.v1 import coordinator_pb2

ENV_PKI_DIR = "FTD_PKI_DIR"


def register(sub: Any) -> argparse.ArgumentParser:
    """Adds ``certs`` to ftctl's sub-command parsers (``sub`` from ``add_subparsers``)."""
    certs = sub.add_parser("certs", help="the cluster PKI: CA, per-identity certificates, rotation")
    _arguments(certs)
    return certs  # type: ignore[no-any-return]


def _arguments(certs: argparse.ArgumentParser) -> None:
    # --pki-dir is accepted before and after the sub-command (ftctl certs issue ... --pki-dir D).
    common = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    for parser in (certs, common):
        parser.add_argument("--pki-dir", type=Path, default=argparse.SUPPRESS,
                            help=f"the PKI directory (env {ENV_PKI_DIR}; default: DIR/pki with --workdir DIR)")
    cmds = certs.add_subparsers(dest="certs_command", required=True)
    _add = cmds.add_parser

    def add_parser(name: str, **kw: Any) -> argparse.ArgumentParser:
        return _add(name, parents=[common], **kw)

    init = add_parser("init", help="create the cluster CA (ca.crt, ca.key)")
    init.add_argument("--cluster", required=True, help="the cluster's name, part of every identity")
    init.add_argument("--days", type=int, default=CA_DAYS, help="CA validity [days] (default %(default)s)")
    init.add_argument("--force", action="store_true", help="replace an existing CA (distrusts all it issued)")
    for name, text in (("issue", "issue a certificate for an identity"),
                       ("rotate", "a new key and certificate for an issued identity")):
        cmd = add_parser(name, help=text)
        cmd.add_argument("kind", choices=KINDS)
        cmd.add_argument("name", help="node id, replica id, member name, operator name")
        cmd.add_argument("--host", action="append", default=None, metavar="HOST",
                         help="a DNS name or IP the identity serves at (repeatable; 127.0.0.1, ::1 and localhost "
                              "always; rotate keeps the old hosts unless given)")
        cmd.add_argument("--days", type=int, default=LEAF_DAYS, help="validity [days] (default %(default)s)")
        cmd.add_argument("--etcd-client", action=argparse.BooleanOptionalAction, default=None,
                         help="a rendezvous certificate that etcd admits, for torchrun --rdzv-backend=etcd-v3 (issue: "
                              "off by default, no certificate a node holds reaches etcd; rotate: as before)")
    rev = add_parser("revoke", help="refuse every call of an identity (or of one certificate, --serial) from now on, "
                                    "on the coordinator and every agent (asks the coordinator)")
    rev.add_argument("identity", nargs="?", metavar="KIND/NAME", help="e.g. node/node-1 (every certificate of it)")
    rev.add_argument("--serial", help="revoke one certificate by its serial (hex, as 'ftctl certs list' shows)")
    rev.add_argument("--reason", default="revoked by ftctl", help="recorded in the deny list and the event log")
    rev.add_argument("--lift", action="store_true", help="remove the entry instead (after re-issuing the identity)")
    for cmd in (cmds.choices["rotate"],):
        cmd.add_argument("--keep-old", action="store_true",
                         help="do not revoke the old certificate (by default its serial is revoked through the "
                              "coordinator, so a stolen old pair stops working)")
    lst = add_parser("list", help="every certificate with its identity, serial, hosts and expiry")
    lst.add_argument("--json", action="store_true", help="machine-readable output")


def pki_dir(args: argparse.Namespace, env: Mapping[str, str]) -> Path:
    """``--pki-dir``, else ``$FTD_PKI_DIR``, else ``DIR/pki`` of ``--workdir``."""
    given = getattr(args, "pki_dir", None) or env.get(ENV_PKI_DIR)
    if given:
        return Path(given)
    workdir = getattr(args, "workdir", None)
    if workdir is not None:
        return Path(workdir) / "pki"
    raise PkiError(f"no PKI directory: give --pki-dir, {ENV_PKI_DIR}, or --workdir of a local cluster")


def list_certificates(root: Path) -> list[dict[str, object]]:
    """Every ``*.crt`` under ``root``, the CA first."""
    if not root.is_dir():
        raise PkiError(f"no PKI directory at {root} (create it with 'ftctl certs init')")
    found = sorted(root.rglob("*.crt"), key=lambda p: (p.name != "ca.crt", str(p)))
    return [certificate_info(p) for p in found]


Connect = Callable[[], CoordinatorClient]


def revoke(connect: Connect, identity: str, serial: str, reason: str, lift: bool = False,
           serial_identity: str = "") -> str:
    """Asks the coordinator to revoke (or ``lift``) ``identity`` or one certificate ``serial``."""
    client = connect()
    try:
        reply = client.call("Revoke", coordinator_pb2.RevokeRequest(
            identity=identity, serial=serial, reason=reason, lift=lift, serial_identity=serial_identity),
            idempotent=True)
        return str(reply.message)
    finally:
        client.close()


def _rotate(root: Path, args: argparse.Namespace, connect: Connect | None) -> None:
    """Rotates, then revokes the old certificate's serial unless ``--keep-old``: a stolen old pair must
    stop working (issue 20). Without a reachable coordinator the rotation stands and says what to run."""
    old = certificate_info(paths(root, args.kind, args.name)[0])
    path = rotate(root, args.kind, args.name, args.host, args.days, getattr(args, "etcd_client", None))
    info = certificate_info(path)
    print(f"{args.kind}/{args.name}: rotated, serial {info['serial']}, until {info['not_after']}")
    if getattr(args, "keep_old", False):
        return
    command = f"ftctl certs revoke --serial {old['serial']} --reason 'rotated'"
    if connect is None:
        print(f"the old certificate still works until revoked: {command}", file=sys.stderr)
        return
    try:
        print(revoke(connect, "", str(old["serial"]), f"rotated: replaced by serial {info['serial']}",
                     serial_identity=f"{args.kind}/{args.name}"))
    except (grpc.RpcError, ConnectionError, ValueError, PkiError) as exc:
        print(f"ftctl certs: the old certificate (serial {old['serial']}) is NOT revoked ({exc}); once the "
              f"coordinator is reachable: {command}", file=sys.stderr)


def run(args: argparse.Namespace, env: Mapping[str, str] | None = None, connect: Connect | None = None) -> int:
    """Runs ``ftctl certs ...``; a :class:`~ftd.identity.PkiError` is printed (it names the file) as exit 1.
    ``connect``: a client of the coordinator, for ``revoke`` and the revocation after ``rotate``."""
    env = os.environ if env is None else env
    try:
        if args.certs_command == "revoke":
            if bool(args.identity) == bool(args.serial):
                print("ftctl certs revoke: give KIND/NAME or --serial SERIAL (one of them)", file=sys.stderr)
                return 2
            if connect is None:
                print("ftctl certs revoke: needs the coordinator (--coordinator or --workdir)", file=sys.stderr)
                return 2
            try:
                print(revoke(connect, args.identity or "", args.serial or "", args.reason, args.lift))
            except grpc.RpcError as exc:
                code = rpc_code(exc)
                print(f"ftctl certs revoke: {code.name if code else '?'}: {rpc_details(exc)}", file=sys.stderr)
                return 1
            return 0
        root = pki_dir(args, env)
        if args.certs_command == "init":
            path = init_ca(root, args.cluster, args.days, force=args.force)
            print(f"CA of cluster {args.cluster}: {path} (keep {root / 'ca.key'} off the nodes)")
        elif args.certs_command == "issue":
            path = issue(root, args.kind, args.name, args.host or (), args.days, etcd_client=args.etcd_client)
            print(f"{args.kind}/{args.name}: {path} (key {paths(root, args.kind, args.name)[1]}, mode 0600)")
        elif args.certs_command == "rotate":
            _rotate(root, args, connect)
        else:
            rows = list_certificates(root)
            if args.json:
                print(json.dumps(rows, indent=2))
            for row in [] if args.json else rows:
                hosts = ",".join(cast("list[str]", row["hosts"])) or "-"
                flag = "  EXPIRED" if row["expired"] else ""
                print(f"{row['identity'] or 'CA':<28} serial {row['serial']:<40} until {row['not_after']}  "
                      f"hosts {hosts}{flag}")
        return 0
    except PkiError as exc:
        print(f"ftctl certs: {exc}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """``ftctl certs`` on its own (``python -m ftd.ftctl.certs ...``)."""
    parser = argparse.ArgumentParser(prog="ftctl certs", description="The cluster PKI.")
    parser.add_argument("--workdir", type=Path, help="a local cluster started by 'ftctl up' (uses DIR/pki)")
    _arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
