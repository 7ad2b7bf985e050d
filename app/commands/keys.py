"""`ragblend keys create|list|revoke`: scoped API keys, managed on a running server with its own key
(server.api_key, as --api-key or RAGBLEND_API_KEY). A created key's token is printed once."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone

from app.commands.client import add_client_arguments, error_message, make_client
from app.commands.exit_codes import ExitCode


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create a key bound to collections with a role; prints its token once")
    create.add_argument("--role", required=True, choices=["read", "write", "admin"],
                        help="read: ask and read; write: also ingest and delete; admin: also change its collections")
    create.add_argument("--collection", action="append", dest="collections", required=True,
                        help="a collection it may use (repeatable)")
    create.add_argument("--name", default="", help="what the key is for")
    create.add_argument("--token-only", action="store_true", help="print the token alone (for scripts)")
    actions.add_parser("list", help="the keys (never their tokens)")
    revoke = actions.add_parser("revoke", help="revoke a key: refused by every replica at its next request")
    revoke.add_argument("key_id")
    for sub in actions.choices.values():
        add_client_arguments(sub)


def run(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        if args.action == "create":
            response = client.post("/v1/keys", json={"role": args.role, "collections": args.collections,
                                                     "name": args.name})
        elif args.action == "list":
            response = client.get("/v1/keys")
        else:
            response = client.delete(f"/v1/keys/{args.key_id}")
    if response.status_code not in (200, 201):
        print(f"ragblend keys {args.action}: {error_message(response)}", file=sys.stderr)
        return ExitCode.FAILED
    body = response.json()
    if args.action == "create":
        if args.token_only:
            print(body["key"])
        else:
            print(f"key {body['id']} ({body['role']} on {', '.join(body['collections'])}): {body['key']}")
            print("the token is shown this once; store it now", file=sys.stderr)
    elif args.action == "list":
        for key in body["keys"]:
            state = "revoked " + _when(key["revoked_at"]) if key["revoked_at"] else "active"
            print(f"{key['id']}  {key['role']:<5}  {','.join(key['collections']) or '-'}  {state}  {key['name']}")
    else:
        print(f"revoked {body['id']}")
    return ExitCode.OK


def _when(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
