"""Mixed-precision helpers of the legacy ORTTrainer API: loss scalers."""

from orttrainer.amp import loss_scaler
from orttrainer.amp.loss_scaler import DynamicLossScaler, LossScaler

__all__ = ["loss_scaler", "DynamicLossScaler", "LossScaler"]
