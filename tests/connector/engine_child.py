"""A second engine process for the remote-hit test: runs one prompt through an engine with a
``--kv-connector`` URL and prints {"tokens": [...], "cached": N} as JSON."""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys

_TESTS = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_TESTS.parent), str(_TESTS)]  # the repo first: `connector` is the package

from connutil import make_engine, run  # noqa: E402


async def main(model_dir: str, url: str, prompt: list[int]) -> None:
    aeng = make_engine(model_dir, url)
    try:
        toks, cached = await run(aeng, prompt)
        res = await aeng.connector.flush()
        assert res.complete, res
    finally:
        await aeng.stop()
    print(json.dumps({"tokens": toks, "cached": cached}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))
