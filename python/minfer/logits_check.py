"""The run-time guard on what the model hands the sampler: a logits row with a NaN or
an Inf means the weights (or a kernel) are broken, and the argmax of NaNs is a
plausible-looking wrong token. Stop instead, naming the step."""

from __future__ import annotations

import math

import numpy as np

from minfer.errors import NumericsError


def check_logits_finite(logits: np.ndarray, step: int | None, what: str = "step") -> None:
    """Raise NumericsError unless every value of `logits` is finite (step None: a pick
    outside a counted loop, named as the last forward).

    It runs once per sampled token, so the common case is one float32 dot product (a
    NaN or Inf makes it non-finite; finite values make it overflow only past ~1e19);
    then one float64 sum, which finite float32 values cannot overflow, so that sum is
    finite exactly when every element is (no temporary mask on either path)."""
    a = np.asarray(logits)
    if a.dtype == np.float32 and math.isfinite(float(np.vdot(a, a))):
        return
    if math.isfinite(float(np.sum(logits, dtype=np.float64))):
        return
    n_nan = int(np.isnan(a).sum())
    n_inf = int(np.isinf(a).sum())
    if step is None:
        where = "the last forward"
    else:
        where = "the prompt (step 0)" if what == "step" and step == 0 else f"{what} {step}"
    raise NumericsError(
        f"the model produced non-finite logits at {where}: {n_nan} NaN and {n_inf} Inf of {a.size} "
        f"values; the model file's weights or hyper-parameters are broken"
    )
