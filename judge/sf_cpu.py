"""``specforge`` on CPU, for the judge only (never in the package or the image).

SpecForge 0.2.0 computes its EAGLE-3 loss with a Triton GPU kernel only
(``specforge.core.loss.LogSoftmaxLoss``, imported by ``specforge.algorithms.eagle3.model``).
This runs SpecForge's own command line (``python -m judge.sf_cpu train -c run.json``) with that
one name bound to the torch reference kept in the same file, ``_compute_loss`` (run eagerly: the
function under its ``torch.compile``). Everything else is SpecForge's: config, data loading,
model, trainer, evaluator, checkpoints, export. Its ``SPECFORGE_DEVICE=cpu`` and
``training.fsdp_sharding: NO_SHARD`` (DDP over gloo) are its own CPU settings.
"""

from __future__ import annotations

import sys

import specforge.algorithms.eagle3.model as eagle3_model
from specforge.cli import main
from specforge.core.loss import _compute_loss


class TorchReferenceLoss:
    """``LogSoftmaxLoss``'s interface (``.apply(logits, target_p, position_mask)``) on the
    reference implementation."""

    apply = staticmethod(_compute_loss.__wrapped__)


if __name__ == "__main__":
    eagle3_model.LogSoftmaxLoss = TorchReferenceLoss
    sys.exit(main())
