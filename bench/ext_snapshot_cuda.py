"""CUDA variant of bench/ext_snapshot.py: the same table for a cache in GPU memory.

Snapshots go to a pinned host slab and restores come from it, so ``bound`` is one pinned
``copy_`` of the same bytes over PCIe/NVLink-C2C (D2H for snapshot, H2D for restore). Runs only
where CUDA is available (exits 0 with a note elsewhere); writes
bench/results/ext_snapshot_cuda.json. Usage: ``python bench/ext_snapshot_cuda.py [--tokens ...]``.
"""

from __future__ import annotations

import sys

import torch

if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("ext_snapshot_cuda: no CUDA device here; nothing measured")
        sys.exit(0)
    from ext_snapshot import main  # same folder (bench/ is sys.path[0] when run as a script)

    main("cuda")
