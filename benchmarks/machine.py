"""What a benchmark ran on: the processor's model name and the vector extensions that decide which kernels run.

Ratios between models depend on the processor (AVX-512 speeds up BERT's fused SDPA more than our bias building;
VNNI and AMX decide how fast int8 products are), so every benchmark prints `describe()` beside its table. The facts
come from the package's `disentangled env` (`disentangled.environment`), which also fills every record.
"""

from __future__ import annotations

from disentangled.environment import EXTENSIONS, describe, processor

__all__ = ["EXTENSIONS", "describe", "processor"]
