"""A registered model by name, checked against the LoRA targets a request names (jobs and inference programs), and
the prompt a job reads its task through on that model."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.responses import field_error
from server.tables import Model
from shared.errors import DataError
from shared.prompts import resolve
from shared.schemas import JobCreate


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


def with_model_prompt(model: Model, spec: JobCreate) -> JobCreate:
    """``spec`` reading its built-in task through the prompt chosen for the model (``shared.prompts.resolve``) when
    it gives none of its own: the stored spec then names the template, answers and chat frame a device renders its
    data with, and the adapter's task key says which prompt it learned (``sst2-<hash>``). 422 naming ``model`` for
    an unreadable prompts file in the model's folder."""
    try:
        template, verbalizer, chat = resolve(
            Path(model.path), spec.task_name, spec.template, spec.verbalizer, spec.chat_template, spec.prompt
        )
    except DataError as exc:
        raise field_error("model", f"the prompts chosen for the model cannot be read: {exc}") from None
    if template == spec.template:
        return spec
    return spec.model_copy(update={"template": template, "verbalizer": verbalizer, "chat_template": chat})
