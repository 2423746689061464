"""A registered model by name, checked against the LoRA targets a request names (jobs and inference programs)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.responses import field_error
from server.tables import Model


def registered_model(session: Session, name: str, targets, field: str = "targets") -> Model:
    """The model named ``name``; 422 naming ``model`` if none, naming ``field`` if a target module is missing."""
    model = session.scalar(select(Model).where(Model.name == name))
    if model is None:
        raise field_error("model", "must name a registered model")
    present = {module.rsplit(".", 1)[-1] for module in model.modules}
    missing = [t for t in targets if t not in present]
    if missing:
        raise field_error(field, f"must be modules of the model: {', '.join(sorted(present))}")
    return model
