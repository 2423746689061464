"""``POST /v1/devices`` (enrollment-code holder) enrolls a device; ``GET /v1/devices`` (user) lists them;
``POST /v1/devices/{id}/revoke`` (its user or the admin) revokes one: its token is refused from the next request
on, by every API process, and its leases are released (``state.leases.revoke_device``)."""

from __future__ import annotations

from fastapi import HTTPException, status

from server import accounts, queries
from server.deps import CurrentUser, ObjectId, SessionDep, UserOrAdmin
from server.responses import errors
from server.router import Router
from server.security import DEVICE_TOKEN, hash_secret, make_token, new_secret, normalize_code
from server.state import leases
from server.tables import Device
from server.views import caller_device
from shared.schemas import DeviceCreate, DeviceEnrolled, DevicePublic, DevicesPublic

router = Router(prefix="/v1/devices", tags=["devices"])


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=DeviceEnrolled,
    responses=errors(400, 401, 413, 422, e401="the enrollment code is unknown, expired or used"),
)
def enroll(body: DeviceCreate, session: SessionDep) -> DeviceEnrolled:
    """Enroll a device with a one-time code; the answer shows its token once."""
    secret = new_secret()
    device = accounts.enroll_device(
        session,
        hash_secret(normalize_code(body.code)),
        hash_secret(secret),
        name=body.name,
        platform=body.platform,
        backend=body.backend,
        memory_mb=body.memory_mb,
        **accounts.cpu_columns(body.cpu),
    )
    if device is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "code: unknown, expired or already used")
    return DeviceEnrolled(device_id=device.id, token=make_token(DEVICE_TOKEN, device.id, secret))


def public(device: Device) -> DevicePublic:
    return DevicePublic.model_validate(device, from_attributes=True)


@router.get("", response_model=DevicesPublic, responses=errors(401, 403))
def list_devices(user: CurrentUser, session: SessionDep) -> DevicesPublic:
    """The caller's devices, with what each reported of itself."""
    devices = queries.devices_of(session, user.id)
    return DevicesPublic(data=[public(d) for d in devices], count=len(devices))


@router.post(
    "/{device_id}/revoke",
    response_model=DevicePublic,
    responses=errors(401, 403, 404, 413, 422, e404="no such device of yours"),
)
def revoke(device_id: ObjectId, caller: UserOrAdmin, session: SessionDep) -> DevicePublic:
    """Revoke a device (a lost or sold phone): its token is refused from now on and the work it held goes back to
    the queue. Revoking a revoked device changes nothing. A user revokes their own devices; the admin any."""
    device = caller_device(session, caller, device_id)
    leases.revoke_device(session, device_id)
    session.refresh(device)
    return public(device)
