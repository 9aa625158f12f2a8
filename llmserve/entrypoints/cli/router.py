"""`llmserve router`: one endpoint in front of llmserve servers already running."""

import argparse

from llmserve.entrypoints.cli.args import add_network_flags, add_route_prefix_flag
from llmserve.entrypoints.cli.command import Command


def cmd_router(args: argparse.Namespace) -> int:
    from llmserve.entrypoints.openai.server import listening_socket
    from llmserve.router.app import (
        build_disaggregated_app,
        build_router_app,
        router_settings,
        run_router,
    )
    from llmserve.router.replicas import Replica

    settings = router_settings(args)  # checked before the port is taken
    if args.prefill:
        app = build_disaggregated_app(args.prefill[0], args.decode[0], settings)
        banner = f"routing to prefill {args.prefill[0]} and decode {args.decode[0]}"
    else:
        app = build_router_app([Replica(i, url) for i, url in enumerate(args.replica)],
                               settings)
        banner = f"routing to {len(args.replica)} replicas"
    sock = listening_socket(args.host, args.port)
    run_router(app, settings, sock, banner, access_log=args.verbose)
    return 0


def _arguments(router: argparse.ArgumentParser) -> None:
    router.add_argument("--replica", action="append", metavar="URL",
                        help="a server's base URL, e.g. http://127.0.0.1:8001 (repeat)")
    router.add_argument("--prefill", action="append", metavar="URL",
                        help="disaggregated prefill/decode: the prefill server's base URL "
                        "(with --decode)")
    router.add_argument("--decode", action="append", metavar="URL",
                        help="disaggregated prefill/decode: the decode server's base URL "
                        "(with --prefill)")
    net = router.add_argument_group("server")
    add_network_flags(net)
    add_route_prefix_flag(net)


def _check_router_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    split = args.prefill or args.decode
    if args.replica and split:
        parser.error("--replica cannot be combined with --prefill/--decode: give --replica "
                     "URL (repeated) for data-parallel replicas, or --prefill URL --decode "
                     "URL for disaggregated prefill/decode")
    if not args.replica and not split:
        parser.error("give the servers to route to: --replica URL (repeated), or "
                     "--prefill URL --decode URL")
    if split and not (args.prefill and args.decode):
        parser.error("--prefill and --decode go together: give one URL for each")
    for flag, urls in (("--prefill", args.prefill), ("--decode", args.decode)):
        if urls and len(urls) > 1:
            parser.error(f"{flag} was given {len(urls)} times: the router takes exactly one "
                         f"prefill server and one decode server")


COMMAND = Command(
    "router", help="one endpoint in front of running llmserve servers",
    description="Route OpenAI requests to llmserve servers already running (prompts that "
    "start alike go to the same server, whose prefix cache holds them; load spills "
    "over), or split each generation request between a prefill server and a decode "
    "server (--prefill, --decode); /health is 200 while every server is, /metrics "
    "labels each server's.",
    add_arguments=_arguments, run=cmd_router, check=_check_router_args)
