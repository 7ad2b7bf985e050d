"""`ragblend collections create|list|delete`: knowledge bases on a running server (creating one needs
the server's own key; deleting one deletes its documents and their KV)."""

from __future__ import annotations

import argparse
import sys

from app.commands.client import add_client_arguments, error_message, make_client
from app.commands.exit_codes import ExitCode


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create a collection")
    create.add_argument("name")
    create.add_argument("--description", default="")
    create.add_argument("--shares-kv", action="store_true",
                        help="share content-addressed KV with the other collections that share it")
    create.add_argument("--kv-budget-bytes", type=int, help="its own KV budget")
    listing = actions.add_parser("list", help="the collections this key sees, with their counts")
    delete = actions.add_parser("delete", help="delete a collection, its documents and their KV")
    delete.add_argument("name")
    for sub in (create, listing, delete):
        add_client_arguments(sub)


def run(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        if args.action == "create":
            body = {"name": args.name, "description": args.description, "shares_kv": args.shares_kv}
            if args.kv_budget_bytes is not None:
                body["kv_budget_bytes"] = args.kv_budget_bytes
            response = client.post("/v1/collections", json=body)
        elif args.action == "list":
            response = client.get("/v1/collections")
        else:
            response = client.delete(f"/v1/collections/{args.name}")
    if response.status_code not in (200, 201):
        print(f"ragblend collections {args.action}: {error_message(response)}", file=sys.stderr)
        return ExitCode.FAILED
    body = response.json()
    if args.action == "create":
        print(f"created collection {body['name']}")
    elif args.action == "list":
        for c in body["collections"]:
            print(f"{c['name']}  {c['num_documents']} documents, {c['num_chunks']} chunks, {c['num_tokens']} tokens, "
                  f"KV {c['kv_bytes']} bytes  ({c['access']})  {c['description']}")
    else:
        print(f"deleted collection {body['name']}: {body['num_documents']} documents, {body['num_chunks']} chunks")
    return ExitCode.OK
