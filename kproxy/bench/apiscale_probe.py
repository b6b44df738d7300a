"""The scale run's sweep: from inside a lab node, connect to many ClusterIPs at once until each has answered.

``kproxy bench apiscale`` (kproxy.bench.apiscale) starts it as ``ip netns exec NODE python -m
kproxy.bench.apiscale_probe`` with a JSON list of ``[ip, port]`` targets on stdin, at the moment it starts kproxy.
Every round opens one real TCP connection to each target not answered yet (all at once, asyncio), sends a line and
waits for the lab's echo server's answer line; a target counts as answering at the wall time its first answer came
back. Rounds repeat every ``--interval`` seconds until every target answered or ``--seconds`` ran out; it prints one
JSON object: ``{"answered": {"IP:PORT": epoch seconds}, "rounds": N, "started": epoch, "errors": {word: count}}``.
Standard library only (it starts in a fresh interpreter inside the namespace); every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import sys
import time

MAX_TARGETS = 100_000
MAX_SECONDS = 3600.0


def _word(exc: OSError) -> str:
    """An error as one word (ECONNRESET, EHOSTUNREACH, ...), whatever asyncio wrapped it in."""
    return errno.errorcode.get(exc.errno or 0, type(exc).__name__)


async def _one(host: str, port: int, timeout: float) -> str:
    """ "" when the echo server answered a line, else the error's word."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (asyncio.TimeoutError, TimeoutError):
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    except OSError as exc:
        return _word(exc)
    try:
        writer.write(b"apiscale\n")
        line = await asyncio.wait_for(reader.readline(), timeout)
        return "" if line.endswith(b"\n") else "closed"
    except (asyncio.TimeoutError, TimeoutError):
        return "timeout"
    except OSError as exc:
        return _word(exc)
    finally:
        writer.close()


async def sweep(
    targets: list[tuple[str, int]], seconds: float, interval: float, timeout: float, parallel: int
) -> dict[str, object]:
    started = time.time()
    deadline = time.monotonic() + min(seconds, MAX_SECONDS)
    answered: dict[str, float] = {}
    errors: dict[str, int] = {}
    limit = asyncio.Semaphore(parallel)

    async def attempt(host: str, port: int) -> None:
        async with limit:
            word = await _one(host, port, timeout)
        if word:
            errors[word] = errors.get(word, 0) + 1
        else:
            answered.setdefault(f"{host}:{port}", time.time())

    rounds = 0
    while time.monotonic() < deadline:
        pending = [(h, p) for h, p in targets if f"{h}:{p}" not in answered]
        if not pending:
            break
        rounds += 1
        round_start = time.monotonic()
        await asyncio.gather(*(attempt(h, p) for h, p in pending))
        await asyncio.sleep(max(0.0, interval - (time.monotonic() - round_start)))
    return {"answered": answered, "rounds": rounds, "started": started, "errors": errors}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=300.0, help="give up after this long")
    p.add_argument("--interval", type=float, default=0.2, help="seconds between the starts of two rounds")
    p.add_argument("--timeout", type=float, default=1.0, help="seconds one connection may take")
    p.add_argument("--parallel", type=int, default=256, help="connections open at once")
    args = p.parse_args(argv)
    raw = json.load(sys.stdin)
    if not isinstance(raw, list) or len(raw) > MAX_TARGETS:
        print(f"want a JSON list of at most {MAX_TARGETS} [ip, port] pairs on stdin", file=sys.stderr)
        return 2
    targets = [(str(h), int(port)) for h, port in raw]
    out = asyncio.run(sweep(targets, args.seconds, args.interval, args.timeout, max(1, args.parallel)))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
