"""A second engine process for the remote-hit test: runs one prompt through an engine with a
``--kv-connector`` URL (and optional engine config fields) and prints {"tokens": [...],
"cached": N} as JSON."""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys

_TESTS = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_TESTS.parent), str(_TESTS)]  # the repo first: `connector` is the package

from connutil import make_engine, run  # noqa: E402


async def main(model_dir: str, url: str, prompt: list[int], engine_kw: dict) -> None:
    aeng = make_engine(model_dir, url, **engine_kw)
    try:
        toks, cached = await run(aeng, prompt)
        res = await aeng.connector.flush()
        assert res.complete, res
    finally:
        await aeng.stop()
    print(json.dumps({"tokens": toks, "cached": cached}))


if __name__ == "__main__":
    # optional 4th argument: EngineConfig fields as JSON (e.g. {"kv_cache_dtype": "fp8_e4m3"})
    kw = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), kw))
