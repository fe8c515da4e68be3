"""--aux_loss_coef checked against the model before any service or rank starts.

The MoE router's load-balancing loss only exists for a mixture-of-experts model (one whose
transformers config has `output_router_logits`, the test OpenRLHF uses too). A coefficient for a
dense model would add nothing, so it fails here with the flag and the fix. Only config.json is read.
"""

from __future__ import annotations

from services.common.config_error import ConfigError


def is_moe_model(pretrain: str) -> bool:
    """Whether the model folder's config is a mixture-of-experts one with a router loss."""
    from transformers import AutoConfig

    return hasattr(AutoConfig.from_pretrained(pretrain), "output_router_logits")


def check_aux_loss_coef(coef: float, pretrain: str, flag: str = "--aux_loss_coef") -> None:
    """ConfigError when coef is negative, or > 0 for a model without a router loss."""
    if coef < 0:
        raise ConfigError(f"{flag} {coef} must be >= 0 (0 = no load-balancing loss; e.g. 0.001)")
    if coef > 0 and pretrain and not is_moe_model(pretrain):
        raise ConfigError(f"{flag} {coef}: the model at {pretrain} is not a mixture-of-experts model (its config "
                          "has no output_router_logits), so it has no router load-balancing loss to add; drop the "
                          "flag or give 0")
