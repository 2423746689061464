"""Memory: what a machine has (parsed from /proc/meminfo) and what an export needs."""

from __future__ import annotations

from shared.memory import free_memory_mb, meminfo_available_mb

MEMINFO = "MemTotal:        8000000 kB\nMemFree:          100000 kB\nMemAvailable:    2097152 kB\n"


def test_meminfo_parsing() -> None:
    assert meminfo_available_mb(MEMINFO) == 2048
    assert meminfo_available_mb("MemTotal: 1 kB\n") is None


def test_this_machine_reports_free_memory() -> None:
    free = free_memory_mb()
    assert free is not None and free > 0


def test_an_export_needs_the_libraries_plus_a_multiple_of_the_float32_weights(tiny_model_dir) -> None:
    """The estimate covers each measured export peak (shared/memory.py), by at most 20 %."""
    from shared.hf_models import count_params, load_model
    from shared.memory import EXPORT_NEED, export_need_mb
    from shared.model_files import float32_bytes

    model, _ = load_model(tiny_model_dir)
    assert float32_bytes(tiny_model_dir) == 4 * count_params(model)  # from the headers alone, tied weights once
    smollm2, tinyllama = 134_515_008 * 4, 1_100_048_384 * 4
    for weights, quantize, measured in (
        (smollm2, "none", 2_401),
        (tinyllama, "none", 9_470),
        (smollm2, "8da4w", 2_898),
        (tinyllama, "8da4w", 7_098),
    ):
        assert measured < export_need_mb(weights, quantize) < 1.2 * measured
    assert export_need_mb(0) == EXPORT_NEED["none"][0] + 1
