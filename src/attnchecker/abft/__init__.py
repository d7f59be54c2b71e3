"""Pure tensor math of checksum-protected GEMMs (imports torch only).

- :mod:`.checksum`: reference checksums from the operands, checksums recomputed from a product.
- :mod:`.tolerance`: dtype-aware rounding-error bounds for comparing them.
- :mod:`.eec`: verification, location and correction (EEC) with a tensor-only report.
- :mod:`.matmul`: :func:`protected_matmul`, the four steps end to end, autograd-safe.
- :mod:`.gemm`: :func:`~.gemm.gemm_check_`, the check and repair of one GEMM by rows and columns
  in few passes, which the backward's linear-layer checks run.
"""

from attnchecker.abft.checksum import Checksums, encode, recompute
from attnchecker.abft.eec import NEAR_INF, Pattern, Report, ValueKind, classify, correct_
from attnchecker.abft.matmul import Corruptor, protected_matmul
from attnchecker.abft.tolerance import magnitude_factor, unit_roundoff

__all__ = [
    "NEAR_INF",
    "Checksums",
    "Corruptor",
    "Pattern",
    "Report",
    "ValueKind",
    "classify",
    "correct_",
    "encode",
    "magnitude_factor",
    "protected_matmul",
    "recompute",
    "unit_roundoff",
]
