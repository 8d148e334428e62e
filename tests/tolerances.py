"""The one table of numerical tolerances the test suite uses (absolute, max-abs error)."""

import torch

# A float64 torch backend against the float64 NumPy oracle.
FLOAT64 = 1e-10
# Lower precisions against the float64 oracle, inputs of unit scale.
LOW_PRECISION = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
# Golden values printed by the seeds with 4 decimals (half a unit in the last place + slack).
PRINTED_4 = 1e-4 * 0.51
# Golden values printed by the seeds with 8 decimals.
PRINTED_8 = 1e-8 * 0.51
