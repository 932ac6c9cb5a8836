"""Child process for the crash test: puts blocks as fast as it can with durable (synced)
write-through, printing each acknowledged durable key. The test kills it with SIGKILL."""

from __future__ import annotations

import asyncio
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from storeutil import make_blocks, make_cfg  # noqa: E402

from kvstore.node.store import NodeStore  # noqa: E402


async def main(root: str, n: int) -> None:
    cfg = make_cfg(pathlib.Path(root), disk__sync=True, dram__capacity="4MiB", disk__capacity="256MiB")
    node = await NodeStore.open(cfg)
    blocks = make_blocks(n, nbytes=128 * 1024, seed=42)

    async def writer(part):
        for i in range(0, len(part), 3):
            batch = part[i : i + 3]
            for (h, _), r in zip(batch, await node.writer.put(batch)):
                if r.durable:
                    print(h.key.hex, flush=True)

    await asyncio.gather(*(writer(blocks[k::4]) for k in range(4)))
    print("DONE", flush=True)
    await asyncio.sleep(3600)  # wait to be killed


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
