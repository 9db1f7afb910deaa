"""Zero-filled numpy arrays backed by transparent huge pages, for large state written on the first step.

The Adam moments (2x the parameters, ~1 GB at GPT-2 small) are zeros that the first optimizer update
writes for the first time. From `np.zeros` (calloc: 4 KiB pages mapped on first touch) that first
write cost 2.8 s of page faults per GB on the shared host (docs/performance.md, "The first run");
from an anonymous mapping advised MADV_HUGEPAGE it cost 0.3 s, and later writes the same. Hosts
whose THP mode is `never` simply get 4 KiB pages (the advice is a hint); where the platform has no
MADV_HUGEPAGE (not Linux) this is np.zeros.
"""

import mmap
import warnings

import numpy as np

# Below one huge page the advice cannot help; small arrays stay in the heap.
MIN_BYTES = 4 << 20

_warned = False


def zeros(shape, dtype) -> np.ndarray:
    """np.zeros(shape, dtype); arrays of MIN_BYTES or more in their own huge-page-advised mapping.

    The array keeps the mapping alive (numpy holds the buffer), and it is unmapped when the last
    array or tensor over it is gone. Anonymous mappings are zero-filled by the kernel."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < MIN_BYTES or advice is None:
        return np.zeros(shape, dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError as error:  # e.g. a kernel built without THP: the plain path, said once
        _warn_once(error)
        region.close()
        return np.zeros(shape, dtype)
    return np.frombuffer(region, dtype).reshape(shape)


def _warn_once(error):
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"madvise(MADV_HUGEPAGE) failed ({error}); large optimizer state uses 4 KiB pages "
                      "(correct, but its first write is slower).", RuntimeWarning, stacklevel=3)
