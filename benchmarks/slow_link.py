"""Run a command over an emulated slow link: inside a fresh network namespace whose loopback is shaped with
tc (htb at --rate, optional netem --delay). Every rank of a torch.distributed run started by the command
talks over that loopback (use tcp://127.0.0.1:PORT or MASTER_ADDR=127.0.0.1), so comm costs what it
would on a link of that rate. The namespace is deleted afterwards, also on Ctrl-C, SIGTERM and --timeout.

    sudo python benchmarks/slow_link.py --rate 1gbit -- python examples/train.py --world-size 4
    sudo python benchmarks/slow_link.py --rate 10gbit --delay 50us --timeout 600 -- torchrun ...

Exit status: the command's own; 128+N when it died from signal N; 124 on --timeout; 130 on Ctrl-C;
2 when this machine cannot shape a link (not root, no ip/tc, no netem for --delay) or on bad arguments.
Measured here (4 MB over one TCP socket inside the namespace): 100mbit -> 100.3 Mbit/s, 1gbit -> 995
Mbit/s; unshaped loopback ~6 Gbit/s.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from typing import List, Optional

from moe_comm.tools.slow_link import parse_delay, parse_rate, run_on_slow_link


def _checked(parse, what: str):
    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text
    check.__name__ = what
    return check


def parse_args(argv: List[str]) -> argparse.Namespace:
    if "--" in argv:
        cut = argv.index("--")
        own, cmd = argv[:cut], argv[cut + 1:]
    else:
        own, cmd = argv, []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s [--rate RATE] [--delay DELAY] [--timeout S] -- CMD [ARGS...]")
    p.add_argument("--rate", default="1gbit", type=_checked(parse_rate, "rate"),
                   help="tc rate of the namespace's loopback, e.g. 1gbit, 100mbit, 10gbit (default 1gbit)")
    p.add_argument("--delay", default=None, type=_checked(parse_delay, "delay"),
                   help="netem delay per packet, e.g. 1ms, 50us (needs the kernel's sch_netem)")
    p.add_argument("--timeout", type=float, default=None, help="kill the command after this many seconds")
    p.add_argument("--netns-name", default=None, help="namespace name (default moecomm-<pid>-<random>)")
    args = p.parse_args(own)
    if not cmd:
        p.error("give the command to run after '--', e.g. -- python train.py")
    args.cmd = cmd
    return args


def _raise_on_sigterm(signum, frame):
    # Turns SIGTERM into an exception so run_on_slow_link's cleanup (kill the command, delete the
    # namespace) runs; the default action would end this process with the namespace left behind.
    raise SystemExit(128 + signum)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        rc = run_on_slow_link(args.cmd, rate=args.rate, delay=args.delay, netns_name=args.netns_name,
                              timeout=args.timeout)
    except (RuntimeError, ValueError) as exc:
        print(f"slow_link: {exc}", file=sys.stderr)
        return 2
    except subprocess.TimeoutExpired:
        print(f"slow_link: command killed after --timeout {args.timeout:g} s", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        return 130
    return 128 - rc if rc < 0 else rc


if __name__ == "__main__":
    sys.exit(main())
