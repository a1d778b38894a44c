"""An A/B switch for benchmarks: with this folder first on PYTHONPATH, every Python process
(ratio.py's children included) runs the Tensor Pool's host memory without its fence (host.py
Rule 4): an offload that finds no free region waits on the host for the copies reading the
regions it takes back, as the runtime did before the fence.

    PYTHONPATH=benchmarks/without_fence:. python benchmarks/ratio.py OUT ...
"""

import superneurons.runtime.pool as _pool
from superneurons.runtime.host import FIRST_CHUNK_BYTES, HostMemory as _HostMemory


class _WithoutFence(_HostMemory):
    def __init__(self, pin, first_chunk_bytes=FIRST_CHUNK_BYTES, fence=None):
        super().__init__(pin, first_chunk_bytes, fence=None)


_pool.HostMemory = _WithoutFence
