"""Device and precision choice: the rule behind `--device auto` and `dtype = "auto"`."""

import pytest
import torch

from kiln import devices
from kiln.devices import Precision, choose_precision, cpu_flags, resolve_device
from kiln.errors import KilnError

CPU = torch.device("cpu")


def test_auto_picks_fp32_without_native_bf16_flags() -> None:
    p = choose_precision("auto", CPU, flags=frozenset({"avx2", "fma"}))
    assert p.name == "fp32" and p.dtype == torch.float32
    assert "no native bf16" in p.describe() and p.describe().startswith("dtype auto → fp32")


def test_auto_picks_bf16_only_when_the_probe_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = frozenset({"avx512_bf16"})
    monkeypatch.setattr(devices, "bf16_probe_ratio", lambda: 0.6)
    assert choose_precision("auto", CPU, flags=flags).name == "bf16"
    monkeypatch.setattr(devices, "bf16_probe_ratio", lambda: 25.0)
    slow = choose_precision("auto", CPU, flags=flags)
    assert slow.name == "fp32" and "25.0x slower" in slow.reason


def test_explicit_bf16_on_emulating_cpu_warns_with_the_measured_slowdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(devices, "bf16_probe_ratio", lambda: 31.0)
    p = choose_precision("bf16", CPU, flags=frozenset())
    assert p.name == "bf16" and p.warning is not None and "31.0x slower" in p.warning
    assert choose_precision("fp32", CPU).warning is None


def test_probe_ratio_is_a_positive_measurement() -> None:
    assert devices.bf16_probe_ratio() > 0


def test_bad_dtype_and_device_are_one_clear_error() -> None:
    with pytest.raises(KilnError, match="auto, fp32 or bf16"):
        choose_precision("fp16x", CPU)
    with pytest.raises(KilnError, match="cpu, cuda"):
        resolve_device("tpu9")
    with pytest.raises(KilnError, match="cpu, cuda"):
        resolve_device("meta")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_cpu_flags_reads_the_flags_line(tmp_path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("model name\t: X\nflags\t\t: fpu avx2 amx_bf16\n")
    assert cpu_flags(info) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_precision_record_round_trips_its_fields() -> None:
    p = Precision("fp32", "auto", "why", None)
    assert p.to_dict() == {
        "dtype": "fp32",
        "requested": "auto",
        "reason": "why",
        "bf16_slowdown": None,
    }


@pytest.mark.parametrize(
    ("capability", "auto", "explicit"),
    [((9, 0), "bf16", "asked for"), ((8, 0), "bf16", "asked for"), ((7, 0), "fp32", "emulates")],
)
def test_gpu_rule_follows_native_bf16_not_emulation(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], auto: str, explicit: str
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU")
    gpu = torch.device("cuda", 0)
    assert choose_precision("auto", gpu).name == auto
    assert explicit in choose_precision("bf16", gpu).reason
    assert choose_precision("fp32", gpu).name == "fp32"
