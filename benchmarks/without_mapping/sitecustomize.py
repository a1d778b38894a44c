"""An A/B switch for benchmarks: with this folder first on PYTHONPATH, every Python process
(claims.py's children included) pins the Tensor Pool's host memory through PyTorch's pinned
allocator, as before host.py Rule 6 mapped it in 2 MiB pages.

    PYTHONPATH=$PWD/benchmarks/without_mapping:$PWD python benchmarks/claims.py OUT ...
"""

import superneurons.runtime.host as _host

_host.maps_itself = lambda: False
